//! One simulated run: every component as a state machine on one thread, driven by one queue of
//! timed actions from one seed. Proxy replicas, the cluster, the calls node and its runners use
//! the production decisions and projections; only the world around them (network, pods, time,
//! faults) is simulated. The invariants are checked as the steps happen and at the end.
//!
//! The parts, all on one `SimClock` and one generator (ChaCha8):
//!
//! * Proxy replicas behind a random load balancer, each with its own log, `SkewedClock`, traffic
//!   counters, view of the ready pods, and lease and last-used state; each drives the production
//!   `Member` of the shared-scaling protocol.
//! * The cluster ([`crate::cluster`]) and the coordination API's latency and errors around every
//!   request.
//! * A calls node (its log and a [`crate::queue::SimQueue`]) serving the runner API's semantics
//!   with the production `decide_start`, `decide_finish` and `decide_timeouts`: own and shared
//!   partitions, runner leases, a machine crash that loses unsynced queue writes, and the queued
//!   calls put back from the log at restart. With `nodes = N` there are N such replicas, each with
//!   its own log, deciding only for the calls it owns and asking the owner otherwise, as the call
//!   service does; an enqueue puts its message and records the call a moment later, as the call
//!   service does, so another replica can read the message in between and must hold it back.
//! * Runners that crash, lose answers and retry, talking to any replica.
//!
//! The checks: as steps happen (a scale-down taking effect, a start accepted, a finish recorded,
//! a request failing); every log replayed against its live state every 5,000 steps, after each
//! restart and at the end; and the end state (every request answered, every acknowledged call
//! final).

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::hash::Hasher;
use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::FutureExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::cluster::{PodTimer, SimCluster};
use crate::log::SimLog;
use crate::queue::SimQueue;
use crate::scenario::{Faults, Range, Scenario};
use ebb_core::calls::{message_of, spec_of};
use ebb_core::clock::{Clock, SimClock, SkewedClock};
use ebb_core::event::{CallKind, CallSpec, Event, Payload, RouteSpec};
use ebb_core::orchestrator::Orchestrator;
use ebb_core::queue::{Message, Queue};
use ebb_core::scaler::member::{Answer, Member, Next, Request};
use ebb_core::scaler::shared::{self, CoordError, SharedOptions};
use ebb_core::scaler::{BackendMiss, retry_after_miss};
use ebb_core::scaler::{Live, Report, decide_observed, decide_wake};
use ebb_core::state::calls::{decide_finish, decide_start, decide_timeouts, timed_out};
use ebb_core::state::{CallStatus, Due, StartVerdict};

const DEPLOYMENT: &str = "app";
const ROUTE: &str = "app";
/// Simulated time starts here, so skewed clocks never go below zero.
const T0: u64 = 1_000_000;
/// Attempts at an API request that keeps failing (wake, last-used bump).
const API_ATTEMPTS: u32 = ebb_core::scaler::member::TOUCH_ATTEMPTS;
/// Attempts at a runner request while the node is down or its answer is lost.
const RUNNER_ATTEMPTS: u32 = 50;
/// Replays of every log are compared with the live state this often (in steps), and at the end.
const REPLAY_EVERY: u64 = 5_000;
/// Trace lines kept for a violation's report.
const TRACE_KEEP: usize = 60;

/// A broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The invariant's name.
    pub invariant: &'static str,
    /// What broke it.
    pub detail: String,
    /// Simulated time since the start.
    pub at_ms: u64,
}

/// Counts of what happened in a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Client requests.
    pub requests: u64,
    /// Requests that met a stopping replica and were retried.
    pub retried: u64,
    /// Scale-downs that took effect.
    pub scale_downs: u64,
    /// Scale-downs refused by the compare-and-swap.
    pub conflicts: u64,
    /// Wakes from zero.
    pub wakes: u64,
    /// Calls acknowledged.
    pub calls: u64,
    /// Calls executed by a runner.
    pub executed: u64,
    /// Crashes of replicas, the calls node and runners.
    pub crashes: u64,
    /// Starts and finishes a node forwarded to the call's owner.
    pub forwarded: u64,
    /// Messages of another node's call held back because its owner had put but not yet
    /// recorded it.
    pub held_unknown: u64,
    /// Calls an owner recorded from the copy another node handed out (it stalled between its
    /// put and its record past the hold-back bound).
    pub recorded_from_copy: u64,
    /// Keep-warm windows opened or renewed.
    pub warm_started: u64,
    /// Steps (actions run).
    pub steps: u64,
}

/// The result of a run.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Hash of the whole trace: equal seeds give equal hashes.
    pub hash: u64,
    /// Simulated milliseconds.
    pub sim_ms: u64,
    /// The first invariant broken, if any.
    pub violation: Option<Violation>,
    /// The trace's last lines (ending at the violation, if any).
    pub trace: Vec<String>,
    /// What happened.
    pub stats: Stats,
}

// ---------------------------------------------------------------------------------------------
// The action queue.

/// A request of a replica to the cluster's API: the protocol's ([`Member`]), or a wake's
/// scale-up.
#[derive(Debug, Clone)]
enum ApiOp {
    Member(Request),
    Wake { to: u32 },
}

#[derive(Debug, Clone)]
enum NodeReq {
    Enqueue(Box<CallSpec>),
    Dequeue {
        max: usize,
    },
    Start {
        ids: Vec<String>,
        duplicate: bool,
    },
    Finish {
        id: String,
        success: bool,
        duplicate: bool,
    },
}

#[derive(Debug, Clone)]
enum NodeAnswer {
    Enqueued,
    Jobs(Vec<CallSpec>),
    Started(Vec<(String, bool)>),
    Finished(CallStatus, String),
    Down,
    /// No answer yet (an enqueue between its put and its record).
    Pending,
}

/// Who sent a node request: the producer or runner `i`.
const PRODUCER: usize = usize::MAX;

#[derive(Debug, Clone)]
enum Action {
    NextBurst,
    Arrive(usize),
    Flush(usize, u32),
    Observe(usize, u32),
    Sync(usize, u32),
    LeaseTick(usize, u32),
    DownscaleTick(usize, u32),
    ApiArrive(usize, u32, ApiOp, u32),
    ApiReply(usize, u32, ApiOp, Result<Answer, CoordError>, u32),
    Pod(PodTimer),
    RequestDone(usize, u32),
    HoldTimeout(usize),
    FaultTick,
    Restart(usize),
    Enqueue(CallSpec, u32),
    RunnerPoll(usize, u32),
    /// A request reaches node (first) from the producer or a runner.
    NodeArrive(usize, usize, u32, NodeReq, u32),
    NodeReply(usize, u32, NodeReq, NodeAnswer, u32),
    /// An enqueue's second step on node (first, at its epoch second): the call recorded in the
    /// log, after its message was put; then the answer to the producer.
    EnqueueRecord(usize, u32, CallSpec, u32),
    CallDone(usize, u32, String),
    Expire,
    NodeRestart(usize),
    RunnerRestart(usize),
}

struct Item {
    at: u64,
    seq: u64,
    action: Action,
}

impl PartialEq for Item {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Item {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

// ---------------------------------------------------------------------------------------------
// The parts.

struct Replica {
    name: String,
    up: bool,
    epoch: u32,
    clock: SkewedClock,
    log: SimLog,
    view: Vec<SocketAddr>,
    /// Replicas the deployment was asked for, as last observed.
    view_desired: u32,
    in_flight: u64,
    last_at: u64,
    count: u64,
    /// The protocol, as the production code runs it.
    member: Member,
    /// When (true time) the bump under way was decided, and the latest such time whose bump
    /// landed: uses up to it are published.
    touch_decided_at: u64,
    published_through: u64,
    held: Vec<usize>,
}

impl Replica {
    /// This replica's time, by its own (skewed) clock.
    fn local(&self) -> u64 {
        self.clock.now_ms()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReqState {
    Pending,
    Held,
    Serving,
    Done,
    Failed,
    /// Lost with the replica that had it (a crash, not a scaling decision).
    Dropped,
}

struct Req {
    replica: usize,
    epoch: u32,
    arrived: u64,
    serve_ms: u64,
    state: ReqState,
    retried: bool,
    pod: Option<SocketAddr>,
    /// Forwards so far; a completion of an earlier one is stale.
    attempt: u32,
    /// Its replica had to bump the shared last use for it.
    needs_publish: bool,
    /// Its use died with its replica before it was published.
    exempt: bool,
}

/// An ebb replica serving calls: its own log; the queue is the world's.
struct Node {
    /// Its name in the trace.
    name: String,
    /// The owner its calls' ids name (`None` with one node: bare ids).
    owner: Option<String>,
    up: bool,
    epoch: u32,
    log: SimLog,
    /// When each runner was last heard from, for its lease.
    heard: std::collections::BTreeMap<String, u64>,
    /// Other nodes' calls handed out while their owner did not know them (past the hold-back
    /// bound), by id: a start of one sends the owner the message's copy (as
    /// `Calls::start_through_owners`). Memory: gone with a crash.
    handed_unknown: HashMap<String, CallSpec>,
    /// Its own calls whose start it refused as unknown (their message deleted): recorded later
    /// (a stalled record), their message is put again (as `Calls::record_queued`). Memory.
    refused_unknown: std::collections::HashSet<String>,
}

struct Runner {
    name: String,
    /// The node it talks to.
    node: usize,
    up: bool,
    epoch: u32,
    busy: usize,
    polling: bool,
}

struct Trace {
    hasher: fnv::FnvHasher,
    tail: VecDeque<String>,
}

impl Trace {
    fn line(&mut self, now: u64, who: &str, what: std::fmt::Arguments<'_>) {
        let line = format!("{:>8} {who:<8} {what}", now - T0);
        self.hasher.write(line.as_bytes());
        if self.tail.len() == TRACE_KEEP {
            self.tail.pop_front();
        }
        self.tail.push_back(line);
    }
}

/// The simulated world of one run.
pub struct World {
    sc: Scenario,
    /// True simulated time, for the parts without a clock of their own.
    clock: SimClock,
    faults: Faults,
    now: u64,
    end: u64,
    seq: u64,
    heap: BinaryHeap<Reverse<Item>>,
    rng: ChaCha8Rng,
    trace: Trace,
    violation: Option<Violation>,
    stats: Stats,
    cluster: Option<Arc<SimCluster>>,
    opts: SharedOptions,
    replicas: Vec<Replica>,
    requests: Vec<Req>,
    /// (true arrival time, request), in time order.
    arrivals: Vec<(u64, usize)>,
    open: BTreeSet<usize>,
    nodes: Vec<Node>,
    /// The call queue, shared by the nodes.
    queue: Option<Arc<SimQueue>>,
    /// Every finish's first answer, by call, whichever node gave it.
    finish_answers: HashMap<String, (CallStatus, String)>,
    runners: Vec<Runner>,
    executions: HashMap<String, u32>,
    acked: Vec<String>,
    next_call: u64,
}

impl World {
    /// A world for `scenario` (its faults already restricted) from `seed`.
    pub fn new(sc: &Scenario, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let clock = SimClock::new(T0);
        let faults = sc.faults.clone();
        let end = T0 + sc.duration_ms + sc.settle_ms;
        let opts = match &sc.proxy {
            Some(p) => SharedOptions {
                sync_ms: p.sync_ms,
                sync_lag_ms: p.sync_lag_ms,
                lease_ms: p.lease_ms,
                max_skew_ms: p.max_skew_ms,
            },
            None => SharedOptions {
                sync_ms: 1,
                sync_lag_ms: 0,
                lease_ms: 1,
                max_skew_ms: 0,
            },
        };
        let cluster = sc.proxy.as_ref().map(|p| {
            Arc::new(SimCluster::new(
                DEPLOYMENT,
                clock.clone(),
                rng.random(),
                p.start_ms,
                p.stop_ms,
                p.stop_grace_ms,
            ))
        });
        let queue = sc.calls.as_ref().map(|c| {
            Arc::new(SimQueue::new(
                clock.clone(),
                rng.random(),
                c.visibility_timeout_ms,
                faults.duplicate_chance,
            ))
        });
        let n = sc.calls.as_ref().map_or(0, |c| c.nodes.max(1));
        let nodes = (0..n)
            .map(|k| Node {
                name: if n == 1 {
                    "node".into()
                } else {
                    format!("node-{k}")
                },
                owner: (n > 1).then(|| format!("node-{k}")),
                up: true,
                epoch: 0,
                log: SimLog::new(),
                heard: std::collections::BTreeMap::new(),
                handed_unknown: HashMap::new(),
                refused_unknown: std::collections::HashSet::new(),
            })
            .collect();
        let mut w = World {
            sc: sc.clone(),
            clock,
            faults,
            now: T0,
            end,
            seq: 0,
            heap: BinaryHeap::new(),
            rng,
            trace: Trace {
                hasher: fnv::FnvHasher::default(),
                tail: VecDeque::with_capacity(TRACE_KEEP),
            },
            violation: None,
            stats: Stats::default(),
            cluster,
            opts,
            replicas: Vec::new(),
            requests: Vec::new(),
            arrivals: Vec::new(),
            open: BTreeSet::new(),
            nodes,
            queue,
            finish_answers: HashMap::new(),
            runners: Vec::new(),
            executions: HashMap::new(),
            acked: Vec::new(),
            next_call: 0,
        };
        w.setup();
        w
    }

    fn setup(&mut self) {
        if let Some(p) = self.sc.proxy.clone() {
            let route = RouteSpec {
                name: ROUTE.into(),
                domains: vec!["app.sim".into()],
                deployment: DEPLOYMENT.into(),
                idle_after_ms: p.idle_after_ms,
                min_replicas: 0,
                max_replicas: 1,
                hold_timeout_ms: p.hold_timeout_ms,
                hold_queue_max: 10_000,
                process: None,
                concurrency: 0,
                max_connecting: 0,
                policy: Default::default(),
                ..Default::default()
            };
            for i in 0..p.replicas {
                let skew = if self.faults.skew && p.max_skew_ms > 0 {
                    let m = p.max_skew_ms as i64;
                    self.rng.random_range(-m..=m)
                } else {
                    0
                };
                let clock = SkewedClock::new(self.clock.clone(), skew);
                let mut log = SimLog::new();
                log.append(
                    vec![Event::RouteUpserted {
                        route: Box::new(route.clone()),
                    }],
                    clock.now_ms(),
                    false,
                );
                self.replicas.push(Replica {
                    name: format!("ebb-{i}"),
                    up: true,
                    epoch: 0,
                    clock,
                    log,
                    view: Vec::new(),
                    view_desired: 0,
                    in_flight: 0,
                    last_at: 0,
                    count: 0,
                    member: Member::new(&format!("ebb-{i}"), self.opts),
                    touch_decided_at: 0,
                    published_through: 0,
                    held: Vec::new(),
                });
                self.start_replica_loops(i);
            }
            self.at(0, Action::NextBurst);
        }
        if let Some(c) = self.sc.calls.clone() {
            for i in 0..c.runners {
                self.runners.push(Runner {
                    name: format!("runner-{i}"),
                    node: i % self.nodes.len(),
                    up: true,
                    epoch: 0,
                    busy: 0,
                    polling: false,
                });
                self.at(0, Action::RunnerPoll(i, 0));
            }
            let first = self.new_call();
            self.at(0, Action::Enqueue(first, 0));
            self.at(0, Action::Expire);
        }
        self.at(100, Action::FaultTick);
    }

    fn start_replica_loops(&mut self, r: usize) {
        let p = self.sc.proxy.clone().expect("proxy scenario");
        let e = self.replicas[r].epoch;
        self.at(0, Action::Observe(r, e));
        self.at(p.flush_ms, Action::Flush(r, e));
        self.at(p.sync_ms / 2 + 1, Action::Sync(r, e));
        self.at(0, Action::LeaseTick(r, e));
        self.at(p.downscale_every_ms, Action::DownscaleTick(r, e));
    }

    // -- helpers --------------------------------------------------------------------------------

    fn at(&mut self, delay: u64, action: Action) {
        self.seq += 1;
        self.heap.push(Reverse(Item {
            at: self.now + delay,
            seq: self.seq,
            action,
        }));
    }

    fn draw(&mut self, [lo, hi]: Range) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// Whether a fault with chance `p` strikes (never once the faults are over).
    fn strikes(&mut self, p: f64) -> bool {
        self.now < T0 + self.sc.duration_ms && p > 0.0 && self.rng.random_bool(p)
    }

    fn latency(&mut self) -> u64 {
        self.draw(self.sc.api.latency_ms)
    }

    fn note(&mut self, who: &str, what: std::fmt::Arguments<'_>) {
        self.trace.line(self.now, who, what);
    }

    fn violate(&mut self, invariant: &'static str, detail: String) {
        if self.violation.is_none() {
            self.trace
                .line(self.now, "VIOLATED", format_args!("{invariant}: {detail}"));
            self.violation = Some(Violation {
                invariant,
                detail,
                at_ms: self.now - T0,
            });
        }
    }

    fn cluster(&self) -> Arc<SimCluster> {
        self.cluster.clone().expect("proxy scenario")
    }

    fn sync_pods(&mut self) {
        if let Some(c) = self.cluster.clone() {
            for (at, t) in c.take_timers() {
                let delay = at.saturating_sub(self.now);
                self.at(delay, Action::Pod(t));
            }
        }
    }

    // -- the run --------------------------------------------------------------------------------

    /// Runs to the end (or the first violation).
    pub fn run(mut self) -> Outcome {
        while let Some(Reverse(item)) = self.heap.pop() {
            if item.at > self.end || self.violation.is_some() {
                break;
            }
            self.now = item.at;
            self.clock.set(self.now);
            self.step(item.action);
            self.stats.steps += 1;
            if self.stats.steps.is_multiple_of(REPLAY_EVERY) {
                self.check_replays();
            }
        }
        if self.violation.is_none() {
            self.now = self.now.max(self.end);
            self.final_checks();
        }
        Outcome {
            hash: self.trace.hasher.finish(),
            sim_ms: self.now - T0,
            violation: self.violation,
            trace: self.trace.tail.into_iter().collect(),
            stats: self.stats,
        }
    }

    fn step(&mut self, action: Action) {
        match action {
            Action::NextBurst => self.next_burst(),
            Action::Arrive(id) => self.arrive(id),
            Action::Flush(r, e) => self.flush(r, e),
            Action::Observe(r, e) => {
                if self.live(r, e) {
                    self.observe(r);
                    let p = self.sc.proxy.clone().expect("proxy");
                    let d = self.draw(p.observe_ms);
                    self.at(d.max(1), Action::Observe(r, e));
                }
            }
            Action::Sync(r, e) => {
                if self.live(r, e) {
                    self.touch_check(r);
                    let every = self.opts.sync_ms / 2 + 1;
                    self.at(every, Action::Sync(r, e));
                }
            }
            Action::LeaseTick(r, e) => self.lease_tick(r, e),
            Action::DownscaleTick(r, e) => self.downscale_tick(r, e),
            Action::ApiArrive(r, e, op, attempt) => self.api_arrive(r, e, op, attempt),
            Action::ApiReply(r, e, op, answer, attempt) => {
                self.api_reply(r, e, op, answer, attempt)
            }
            Action::Pod(t) => {
                let fired = self.cluster().fire(t);
                if let Some(what) = fired.what {
                    self.note("cluster", format_args!("{what}"));
                }
                if let Some(addr) = fired.killed {
                    self.killed(addr);
                }
            }
            Action::RequestDone(id, attempt) => self.request_done(id, attempt),
            Action::HoldTimeout(id) => {
                if self.requests[id].state == ReqState::Held {
                    let hold = self.sc.proxy.as_ref().map_or(0, |p| p.hold_timeout_ms);
                    self.fail(id, format!("held {hold} ms without a ready replica: 503"));
                }
            }
            Action::FaultTick => self.fault_tick(),
            Action::Restart(r) => self.restart(r),
            Action::Enqueue(spec, attempt) => self.enqueue(spec, attempt),
            Action::RunnerPoll(i, e) => self.runner_poll(i, e),
            Action::NodeArrive(k, from, e, req, attempt) => {
                self.node_arrive(k, from, e, req, attempt)
            }
            Action::NodeReply(to, e, req, answer, attempt) => {
                self.node_reply(to, e, req, answer, attempt)
            }
            Action::EnqueueRecord(k, epoch, spec, attempt) => {
                self.enqueue_record(k, epoch, spec, attempt)
            }
            Action::CallDone(i, e, id) => self.call_done(i, e, id),
            Action::Expire => self.expire(),
            Action::NodeRestart(k) => self.node_restart(k),
            Action::RunnerRestart(i) => {
                // Back through the Service: to any replica.
                let node = self.rng.random_range(0..self.nodes.len().max(1));
                let r = &mut self.runners[i];
                r.up = true;
                r.busy = 0;
                r.polling = false;
                r.node = node;
                let (name, e) = (r.name.clone(), r.epoch);
                self.note(&name, format_args!("restarted"));
                self.at(0, Action::RunnerPoll(i, e));
            }
        }
    }

    fn live(&self, r: usize, e: u32) -> bool {
        let rep = &self.replicas[r];
        rep.up && rep.epoch == e
    }

    // -- the proxy ------------------------------------------------------------------------------

    fn next_burst(&mut self) {
        if self.now >= T0 + self.sc.duration_ms {
            return;
        }
        let t = self.sc.proxy.clone().expect("proxy").traffic;
        let n = self.draw(t.burst);
        let mut offset = 0;
        for _ in 0..n {
            let serve_ms = if t.long_chance > 0.0 && self.rng.random_bool(t.long_chance) {
                self.draw(t.long_ms)
            } else {
                self.draw(t.serve_ms)
            };
            let id = self.requests.len();
            self.requests.push(Req {
                replica: 0,
                epoch: 0,
                arrived: 0,
                serve_ms,
                state: ReqState::Pending,
                retried: false,
                pod: None,
                attempt: 0,
                needs_publish: false,
                exempt: false,
            });
            self.open.insert(id);
            self.at(offset, Action::Arrive(id));
            offset += self.draw(t.spacing_ms);
        }
        let gap = self.draw(t.gap_ms);
        self.at(offset + gap, Action::NextBurst);
    }

    fn arrive(&mut self, id: usize) {
        let up: Vec<usize> = (0..self.replicas.len())
            .filter(|&r| self.replicas[r].up)
            .collect();
        if up.is_empty() {
            // No replica behind the load balancer: the client tries again.
            self.at(100, Action::Arrive(id));
            return;
        }
        let r = up[self.rng.random_range(0..up.len())];
        self.stats.requests += 1;
        let now = self.now;
        let rep = &mut self.replicas[r];
        let local = rep.local();
        let needs_publish = shared::decide_touch(
            rep.member.known_used(DEPLOYMENT),
            local,
            0,
            local,
            &self.opts,
        )
        .is_some();
        rep.in_flight += 1;
        rep.count += 1;
        rep.last_at = rep.last_at.max(local);
        let epoch = rep.epoch;
        let req = &mut self.requests[id];
        req.replica = r;
        req.epoch = epoch;
        req.arrived = now;
        req.needs_publish = needs_publish;
        self.arrivals.push((now, id));
        let name = self.replicas[r].name.clone();
        self.note(&name, format_args!("request {id} arrives"));
        self.touch_check(r);
        self.route(id, None);
    }

    fn route(&mut self, id: usize, avoid: Option<SocketAddr>) {
        let q = &self.requests[id];
        let r = q.replica;
        if !self.live(r, q.epoch) || !matches!(q.state, ReqState::Pending | ReqState::Held) {
            // Its replica crashed meanwhile: the request went with it.
            return;
        }
        let choices: Vec<SocketAddr> = self.replicas[r]
            .view
            .iter()
            .copied()
            .filter(|a| Some(*a) != avoid)
            .collect();
        if choices.is_empty() {
            self.hold(id);
        } else {
            let addr = choices[self.rng.random_range(0..choices.len())];
            self.forward(id, addr);
        }
    }

    fn forward(&mut self, id: usize, addr: SocketAddr) {
        let r = self.requests[id].replica;
        let name = self.replicas[r].name.clone();
        match self.cluster().connect(addr) {
            Ok(()) => {
                let req = &mut self.requests[id];
                req.state = ReqState::Serving;
                req.pod = Some(addr);
                req.attempt += 1;
                let (serve, attempt) = (req.serve_ms, req.attempt);
                self.note(&name, format_args!("request {id} -> {addr}"));
                self.at(serve, Action::RequestDone(id, attempt));
            }
            Err(state) => {
                let retried = self.requests[id].retried;
                if retry_after_miss(BackendMiss::Refused, retried) {
                    self.stats.retried += 1;
                    self.note(
                        &name,
                        format_args!("request {id} refused by {addr} ({state}); retrying"),
                    );
                    self.requests[id].retried = true;
                    // Another ready replica in this proxy's (possibly stale) view, or a hold
                    // and a wake, as the proxy does.
                    self.route(id, Some(addr));
                } else {
                    self.fail(
                        id,
                        format!("refused by {addr} ({state}) and not retried: 502"),
                    );
                }
            }
        }
    }

    fn hold(&mut self, id: usize) {
        let r = self.requests[id].replica;
        if self.requests[id].state != ReqState::Held {
            self.requests[id].state = ReqState::Held;
            self.replicas[r].held.push(id);
            let t = self.sc.proxy.as_ref().map_or(0, |p| p.hold_timeout_ms);
            self.at(t, Action::HoldTimeout(id));
        }
        self.wake(r);
    }

    /// Appends `events` to replica `r`'s log; false if the write was torn (the replica crashed).
    fn append(&mut self, r: usize, events: Vec<Event>) -> bool {
        if events.is_empty() {
            return true;
        }
        let torn = self.strikes(self.faults.torn_write_chance);
        let local = self.replicas[r].local();
        for e in &events {
            let (name, what) = (self.replicas[r].name.clone(), e.name());
            self.note(&name, format_args!("logs {what} {}", describe(e)));
        }
        self.replicas[r].log.append(events, local, torn);
        if torn {
            let name = self.replicas[r].name.clone();
            self.note(&name, format_args!("torn write"));
            self.crash(r);
            return false;
        }
        true
    }

    /// As the proxy's wake: log the decision (once per wake), then make sure the deployment is
    /// asked to run, as far as this replica's view of it tells.
    fn wake(&mut self, r: usize) {
        if let Some(event) =
            decide_wake(&self.replicas[r].log.state, ROUTE, self.replicas[r].local())
            && !self.append(r, vec![event])
        {
            return;
        }
        let want = ebb_core::scaler::awake_replicas(&ebb_core::event::RouteSpec::default());
        if self.replicas[r].view_desired < want {
            self.replicas[r].view_desired = want;
            self.stats.wakes += 1;
            self.api(r, ApiOp::Wake { to: want }, 0, 0);
        }
    }

    fn observe(&mut self, r: usize) {
        let c = self.cluster();
        let observed = c.observe(DEPLOYMENT).unwrap_or_default();
        let shared = c.deployment_now(DEPLOYMENT).unwrap_or_default();
        {
            let rep = &mut self.replicas[r];
            rep.view = observed.ready.clone();
            rep.view_desired = observed.desired;
            rep.member.saw(DEPLOYMENT, shared.last_used_ms);
        }
        if let Some(peer) = shared::decide_peer(&self.replicas[r].log.state, DEPLOYMENT, &shared)
            && !self.append(r, vec![peer])
        {
            return;
        }
        let report = Report {
            ready: observed.ready.len() as u32,
            ..Report::default()
        };
        let facts = decide_observed(&self.replicas[r].log.state, DEPLOYMENT, &report);
        if !self.append(r, facts) {
            return;
        }
        let held = std::mem::take(&mut self.replicas[r].held);
        if held.is_empty() {
            return;
        }
        if self.replicas[r].view.is_empty() {
            self.replicas[r].held = held;
            self.wake(r);
        } else {
            for id in held {
                if self.requests[id].state == ReqState::Held {
                    self.requests[id].state = ReqState::Pending;
                    self.route(id, None);
                }
            }
        }
    }

    fn touch_check(&mut self, r: usize) {
        let now = self.now;
        let rep = &mut self.replicas[r];
        let local = rep.local();
        if let Some(request) = rep
            .member
            .touch_check(DEPLOYMENT, rep.last_at, rep.in_flight, local)
        {
            rep.touch_decided_at = now;
            self.api(r, ApiOp::Member(request), 0, 0);
        }
    }

    fn flush(&mut self, r: usize, e: u32) {
        if !self.live(r, e) {
            return;
        }
        let every = self.sc.proxy.as_ref().map_or(1_000, |p| p.flush_ms);
        self.at(every, Action::Flush(r, e));
        let rep = &mut self.replicas[r];
        if rep.count == 0 {
            return;
        }
        let event = Event::RequestsSeen {
            route: ROUTE.into(),
            count: std::mem::take(&mut rep.count),
            last_at_ms: rep.last_at,
        };
        self.append(r, vec![event]);
    }

    fn lease_tick(&mut self, r: usize, e: u32) {
        if !self.live(r, e) {
            return;
        }
        self.at(self.opts.lease_ms / 3 + 1, Action::LeaseTick(r, e));
        if let Some(request) = self.replicas[r].member.lease_tick() {
            self.api(r, ApiOp::Member(request), 0, 0);
        }
    }

    fn downscale_tick(&mut self, r: usize, e: u32) {
        if !self.live(r, e) {
            return;
        }
        let every = self
            .sc
            .proxy
            .as_ref()
            .map_or(1_000, |p| p.downscale_every_ms);
        self.at(every, Action::DownscaleTick(r, e));
        let rep = &mut self.replicas[r];
        let local = rep.local();
        if let Some(request) = rep.member.downscale_tick(DEPLOYMENT, local) {
            self.api(r, ApiOp::Member(request), 0, 0);
        }
    }

    /// Sends an API request from replica `r` after `extra` ms (a pause) plus the network.
    fn api(&mut self, r: usize, op: ApiOp, attempt: u32, extra: u64) {
        if !self.replicas[r].up {
            return;
        }
        let lat = self.latency();
        let e = self.replicas[r].epoch;
        self.at(extra + lat, Action::ApiArrive(r, e, op, attempt));
    }

    fn api_arrive(&mut self, r: usize, e: u32, op: ApiOp, attempt: u32) {
        // The request reached the API server; it is served even if its sender died since.
        let answer = if self.strikes(self.faults.api_error_chance) {
            Err(CoordError::Unavailable("simulated API error".into()))
        } else {
            let c = self.cluster();
            match &op {
                ApiOp::Member(Request::Read { deployment }) => {
                    c.deployment_now(deployment).map(Answer::Deployment)
                }
                ApiOp::Wake { to } => self.scale(r, *to, None),
                ApiOp::Member(Request::ScaleDown { to, if_version, .. }) => {
                    self.scale(r, *to, *if_version)
                }
                ApiOp::Member(Request::Touch {
                    deployment,
                    last_used_ms,
                }) => {
                    let name = self.replicas[r].name.clone();
                    self.note(
                        &name,
                        format_args!("publishes last use {}", last_used_ms.saturating_sub(T0)),
                    );
                    c.touch_now(deployment, *last_used_ms).map(Answer::Version)
                }
                ApiOp::Member(Request::ReadLease) => c.lease_now().map(Answer::Lease),
                ApiOp::Member(Request::TakeLease {
                    until_ms,
                    if_version,
                }) => {
                    let name = self.replicas[r].name.clone();
                    c.take_lease_now(&name, *until_ms, *if_version)
                        .map(Answer::Version)
                }
            }
        };
        let lat = self.latency();
        self.at(lat, Action::ApiReply(r, e, op, answer, attempt));
    }

    /// A scale write reaching the cluster.
    fn scale(&mut self, r: usize, to: u32, if_version: Option<u64>) -> Result<Answer, CoordError> {
        let c = self.cluster();
        let before = c
            .deployment_now(DEPLOYMENT)
            .map(|d| d.replicas)
            .unwrap_or(0);
        let done = c.scale_now(DEPLOYMENT, to, if_version);
        if done.is_ok() {
            let name = self.replicas[r].name.clone();
            self.note(
                &name,
                format_args!("scaled the deployment {before} -> {to}"),
            );
            if to < before {
                self.stats.scale_downs += 1;
                self.check_downscale();
            }
        }
        self.sync_pods();
        done.map(Answer::Version)
    }

    fn api_reply(
        &mut self,
        r: usize,
        e: u32,
        op: ApiOp,
        answer: Result<Answer, CoordError>,
        attempt: u32,
    ) {
        if !self.live(r, e) {
            return;
        }
        let request = match op {
            ApiOp::Wake { to } => {
                if answer.is_err() && attempt + 1 < API_ATTEMPTS {
                    self.api(r, ApiOp::Wake { to }, attempt + 1, 0);
                }
                return;
            }
            ApiOp::Member(request) => request,
        };
        let touched = matches!(request, Request::Touch { .. }) && answer.is_ok();
        let rep = &mut self.replicas[r];
        let local = rep.local();
        let live = Live {
            in_flight: rep.in_flight,
            last_at_ms: rep.last_at,
        };
        let next = rep
            .member
            .answer(request, answer, attempt, &rep.log.state, live, local);
        if touched {
            let rep = &mut self.replicas[r];
            rep.published_through = rep.published_through.max(rep.touch_decided_at);
        }
        match next {
            Next::Done => {}
            Next::Send {
                request: request @ Request::ScaleDown { .. },
                attempt,
            } => {
                let pause = if self.strikes(self.faults.pause_chance) {
                    self.draw(self.faults.pause_ms)
                } else {
                    0
                };
                if pause > 0 {
                    let name = self.replicas[r].name.clone();
                    self.note(&name, format_args!("pauses {pause} ms before scaling down"));
                }
                self.api(r, ApiOp::Member(request), attempt, pause);
            }
            Next::Send { request, attempt } => self.api(r, ApiOp::Member(request), attempt, 0),
            Next::Record(decision) => {
                self.append(r, vec![*decision]);
            }
            Next::Refused => {
                self.stats.conflicts += 1;
                let name = self.replicas[r].name.clone();
                self.note(
                    &name,
                    format_args!("scale-down refused: the deployment changed"),
                );
            }
        }
        if touched {
            // Uses since the bump was decided may need another.
            self.touch_check(r);
        }
    }

    /// Invariant `no_downscale_while_used`, checked when a scale-down takes effect: no request
    /// arrived within `idle_after_ms` before it, except within the sync lag (those could not be
    /// known; they must be saved by the retry), and none older than the lag is still in flight.
    fn check_downscale(&mut self) {
        let Some(p) = self.sc.proxy.clone() else {
            return;
        };
        let now = self.now;
        let lag = self.opts.sync_lag_ms;
        let from = now.saturating_sub(p.idle_after_ms);
        let to = now.saturating_sub(lag);
        if to > from {
            let lo = self.arrivals.partition_point(|(t, _)| *t <= from);
            let hi = self.arrivals.partition_point(|(t, _)| *t <= to);
            if let Some(&(t, id)) = self.arrivals[lo..hi]
                .iter()
                .find(|(_, id)| !self.requests[*id].exempt)
            {
                let r = self.requests[id].replica;
                self.violate(
                    "no_downscale_while_used",
                    format!(
                        "scaled down while request {id} seen by {} {} ms ago counted (idle_after {} ms, sync lag {lag} ms)",
                        self.replicas[r].name,
                        now - t,
                        p.idle_after_ms
                    ),
                );
                return;
            }
        }
        let stale = self.open.iter().copied().find(|&id| {
            let q = &self.requests[id];
            matches!(q.state, ReqState::Held | ReqState::Serving) && q.arrived <= to && !q.exempt
        });
        if let Some(id) = stale {
            let q = &self.requests[id];
            let what = format!(
                "scaled down while request {id} ({:?}, arrived {} ms ago) was in flight",
                q.state,
                now - q.arrived
            );
            self.violate("no_downscale_while_used", what);
        }
    }

    fn request_done(&mut self, id: usize, attempt: u32) {
        if self.requests[id].attempt != attempt {
            // An earlier forward, ended by a kill and retried.
            return;
        }
        let c = self.cluster();
        if let Some(pod) = self.requests[id].pod.take() {
            c.done(pod);
            self.sync_pods();
        }
        let q = &mut self.requests[id];
        if q.state != ReqState::Serving {
            return;
        }
        q.state = ReqState::Done;
        let (r, e) = (q.replica, q.epoch);
        self.open.remove(&id);
        if self.live(r, e) {
            let rep = &mut self.replicas[r];
            rep.in_flight = rep.in_flight.saturating_sub(1);
            let local = rep.local();
            rep.last_at = rep.last_at.max(local);
        }
    }

    fn fail(&mut self, id: usize, why: String) {
        let q = &mut self.requests[id];
        q.state = ReqState::Failed;
        let (r, e, arrived) = (q.replica, q.epoch, q.arrived);
        self.open.remove(&id);
        if self.live(r, e) {
            let rep = &mut self.replicas[r];
            rep.in_flight = rep.in_flight.saturating_sub(1);
            rep.held.retain(|h| *h != id);
        }
        let name = self.replicas[r].name.clone();
        self.violate(
            "request_not_lost",
            format!(
                "request {id} (arrived {} ms ago at {name}): {why}",
                self.now - arrived
            ),
        );
    }

    /// A pod was killed with requests in flight: each meets a connection closed before any
    /// answer and is retried (they carry no body and are idempotent) or lost.
    fn killed(&mut self, addr: SocketAddr) {
        let ids: Vec<usize> = self
            .open
            .iter()
            .copied()
            .filter(|&id| {
                let q = &self.requests[id];
                q.state == ReqState::Serving && q.pod == Some(addr)
            })
            .collect();
        for id in ids {
            let q = &mut self.requests[id];
            q.pod = None;
            let (r, e, retried) = (q.replica, q.epoch, q.retried);
            if !self.live(r, e) {
                continue;
            }
            if retry_after_miss(BackendMiss::WentAway { replayable: true }, retried) {
                self.stats.retried += 1;
                let name = self.replicas[r].name.clone();
                self.note(
                    &name,
                    format_args!("request {id} lost its connection to {addr}; retrying"),
                );
                let q = &mut self.requests[id];
                q.retried = true;
                q.state = ReqState::Pending;
                self.route(id, Some(addr));
            } else {
                self.fail(
                    id,
                    format!("{addr} was killed while serving it, not retried: 502"),
                );
            }
        }
    }

    fn crash(&mut self, r: usize) {
        self.stats.crashes += 1;
        let name = self.replicas[r].name.clone();
        self.note(&name, format_args!("crashes"));
        // Uses that needed a bump which had not landed die with the replica: nobody else can
        // know of them. (Uses within the sync interval of the shared value are covered by the
        // leader's margin; uses a landed bump covered are known.)
        let (epoch, published) = (self.replicas[r].epoch, self.replicas[r].published_through);
        for &(_, id) in self.arrivals.iter().rev() {
            let q = &mut self.requests[id];
            if q.arrived <= published {
                break;
            }
            if q.replica == r && q.epoch == epoch && q.needs_publish {
                q.exempt = true;
            }
        }
        let lost: Vec<usize> = self
            .open
            .iter()
            .copied()
            .filter(|&id| {
                let q = &self.requests[id];
                q.replica == r
                    && q.epoch == epoch
                    && q.arrived > 0
                    && matches!(
                        q.state,
                        ReqState::Pending | ReqState::Held | ReqState::Serving
                    )
            })
            .collect();
        for id in lost {
            self.requests[id].state = ReqState::Dropped;
            self.open.remove(&id);
        }
        let rep = &mut self.replicas[r];
        rep.up = false;
        rep.epoch += 1;
        rep.in_flight = 0;
        rep.count = 0;
        rep.held.clear();
        rep.view.clear();
        let restart = self.draw(self.faults.restart_ms);
        self.at(restart.max(1), Action::Restart(r));
    }

    fn restart(&mut self, r: usize) {
        let name = self.replicas[r].name.clone();
        if let Err(why) = self.replicas[r].log.crash_and_recover() {
            self.violate(
                "replay_equals_live",
                format!("{name} cannot replay its log: {why}"),
            );
            return;
        }
        let rep = &mut self.replicas[r];
        rep.up = true;
        rep.last_at = 0;
        rep.member.reset();
        let seq = self.replicas[r].log.state.seq;
        self.note(&name, format_args!("restarted from its log (seq {seq})"));
        self.start_replica_loops(r);
    }

    fn fault_tick(&mut self) {
        if self.now >= T0 + self.sc.duration_ms {
            return;
        }
        self.at(100, Action::FaultTick);
        let p = self.faults.crash_per_s / 10.0;
        if p <= 0.0 {
            return;
        }
        for r in 0..self.replicas.len() {
            if self.replicas[r].up && self.strikes(p) {
                self.crash(r);
            }
        }
        for k in 0..self.nodes.len() {
            if self.nodes[k].up && self.strikes(p) {
                self.crash_node(k, false);
            }
        }
        if self.queue.is_some() && self.strikes(self.faults.rebalance_per_s / 10.0) {
            let moved = self.queue().rebalance();
            self.note(
                "queue",
                format_args!("rebalance: {moved} messages read again"),
            );
        }
    }

    // -- calls ----------------------------------------------------------------------------------

    /// The node that owns `id` (the one its id names; node 0 when there is one node).
    fn owner_node(&self, id: &str) -> usize {
        ebb_core::ids::owner_of(id)
            .and_then(|o| {
                self.nodes
                    .iter()
                    .position(|n| n.owner.as_deref() == Some(o))
            })
            .unwrap_or(0)
    }

    fn queue(&self) -> Arc<SimQueue> {
        self.queue.clone().expect("calls scenario")
    }

    fn new_call(&mut self) -> CallSpec {
        let c = self.sc.calls.clone().expect("calls scenario");
        self.next_call += 1;
        // Partitions restrict delivery on the embedded queue only; a shared queue (Kafka)
        // spreads messages over consumers whatever their key.
        let partition = if c.nodes == 1 && self.rng.random_bool(0.5) {
            let i = self.rng.random_range(0..c.runners);
            Some(format!("runner-{i}"))
        } else {
            None
        };
        // The producer picks a replica; the call is that replica's.
        let node = self.rng.random_range(0..self.nodes.len());
        let uuid = uuid::Uuid::from_u128(self.rng.random());
        CallSpec {
            id: ebb_core::ids::id_of(self.nodes[node].owner.as_deref(), uuid),
            target: "app".into(),
            kind: CallKind::Async,
            timeout_ms: c.timeout_ms,
            partition,
            trace: None,
            tracestate: None,
            baggage: None,
            payload: Payload::default(),
        }
    }

    /// Sends a request to node `node` from the producer or runner `from`.
    fn send(&mut self, from: usize, req: NodeReq, attempt: u32, extra: u64) {
        let (node, e) = match (&req, from) {
            // An enqueue goes to the call's owner, retries included (its id names it).
            (NodeReq::Enqueue(spec), PRODUCER) => (self.owner_node(&spec.id), 0),
            _ => (self.runners[from].node, self.runners[from].epoch),
        };
        let lat = self.latency();
        self.at(extra + lat, Action::NodeArrive(node, from, e, req, attempt));
    }

    fn enqueue(&mut self, spec: CallSpec, attempt: u32) {
        if attempt == 0 {
            if self.now >= T0 + self.sc.duration_ms {
                return;
            }
            let gap = self.sc.calls.as_ref().map_or([100, 100], |c| c.gap_ms);
            let gap = self.draw(gap);
            let next = self.new_call();
            self.at(gap.max(1), Action::Enqueue(next, 0));
        }
        self.send(PRODUCER, NodeReq::Enqueue(Box::new(spec)), attempt, 0);
    }

    /// Appends to node `k`'s log; `false` when a torn write crashed it.
    fn node_append(&mut self, k: usize, events: Vec<Event>) -> bool {
        if events.is_empty() {
            return true;
        }
        let torn = self.strikes(self.faults.torn_write_chance);
        let who = self.nodes[k].name.clone();
        for e in &events {
            self.note(&who, format_args!("logs {} {}", e.name(), describe(e)));
        }
        let now = self.now;
        self.nodes[k].log.append(events, now, torn);
        if torn {
            self.note(&who, format_args!("torn write"));
            self.crash_node(k, true);
            return false;
        }
        true
    }

    fn node_arrive(&mut self, k: usize, from: usize, e: u32, req: NodeReq, attempt: u32) {
        let answer = if self.nodes[k].up {
            self.serve_node(k, from, &req, attempt)
        } else {
            NodeAnswer::Down
        };
        if matches!(answer, NodeAnswer::Pending) {
            return;
        }
        let lat = self.latency();
        self.at(lat, Action::NodeReply(from, e, req, answer, attempt));
    }

    /// An enqueue's record on node `k`, its message put already (as `Calls::enqueue`: put,
    /// then record), unless the node went down in between: then it is not acknowledged.
    fn enqueue_record(&mut self, k: usize, epoch: u32, spec: CallSpec, attempt: u32) {
        let node = &self.nodes[k];
        let answer = if !node.up || node.epoch != epoch {
            NodeAnswer::Down
        } else if self.node_state(k).calls.get(&spec.id).is_some()
            || self.node_append(
                k,
                vec![Event::CallQueued {
                    call: std::sync::Arc::new(spec.clone()),
                }],
            )
        {
            if self.nodes[k].refused_unknown.remove(&spec.id) {
                // Its start was refused as unknown and its message deleted meanwhile: put again.
                let who = self.nodes[k].name.clone();
                self.note(
                    &who,
                    format_args!("puts {} again (its message was deleted)", spec.id),
                );
                let _ = self.queue().put(vec![message_of(&spec)]).now_or_never();
            }
            NodeAnswer::Enqueued
        } else {
            NodeAnswer::Down
        };
        let lat = self.latency();
        self.at(
            lat,
            Action::NodeReply(
                PRODUCER,
                0,
                NodeReq::Enqueue(Box::new(spec)),
                answer,
                attempt,
            ),
        );
    }

    fn runner_name(&self, from: usize) -> String {
        if from == PRODUCER {
            "producer".into()
        } else {
            self.runners[from].name.clone()
        }
    }

    fn node_state(&self, k: usize) -> &ebb_core::state::State {
        &self.nodes[k].log.state
    }

    /// Whether node `k` decides for `id` itself (as `Calls` does: its own calls, or every call
    /// under the `decide-for-others` mutation); otherwise it asks the owner.
    fn decides(&self, k: usize, id: &str) -> bool {
        ebb_core::ids::decides_here(self.nodes[k].owner.as_deref(), id)
    }

    /// The start of `id` for `runner`, decided by node `j` on its log (as `Calls::start`):
    /// `Some(accepted)`, or `None` when `j` crashed on its write.
    fn start_on(&mut self, j: usize, id: &str, runner: &str) -> Option<bool> {
        let c = self.sc.calls.clone().expect("calls scenario");
        let now = self.now;
        let queue = self.queue();
        // Hold first (a queued call only), as the call service does.
        if self
            .node_state(j)
            .calls
            .get(id)
            .is_some_and(|c| c.status == CallStatus::Queued)
        {
            let until = now + c.timeout_ms + c.hold_grace_ms;
            let _ = queue.hold(vec![(id.to_owned(), until)]).now_or_never();
        }
        let unknown = self.node_state(j).calls.get(id).is_none();
        let (event, verdict) = decide_start(&self.node_state(j).calls, id, runner, now);
        if !self.node_append(j, vec![event]) {
            return None;
        }
        let accepted = verdict == StartVerdict::Accepted;
        if unknown
            && !accepted
            && !ebb_core::mutation::active(ebb_core::mutation::Mutation::RefuseUnknownCopy)
        {
            self.nodes[j].refused_unknown.insert(id.to_owned());
        }
        if !accepted {
            let _ = queue.delete(vec![id.to_owned()]).now_or_never();
        }
        Some(accepted)
    }

    /// [`Self::start_on`] on the owner `j`, which first records the call from the message's
    /// copy a forwarding node sent along if its log does not know it yet (as `Calls::start`
    /// does with the copies `Calls::start_through_owners` sends): put by `j`, not recorded yet.
    fn start_with_copy(
        &mut self,
        j: usize,
        id: &str,
        runner: &str,
        copy: Option<CallSpec>,
    ) -> Option<bool> {
        if let Some(spec) = copy
            && !ebb_core::mutation::active(ebb_core::mutation::Mutation::RefuseUnknownCopy)
            && self.node_state(j).calls.get(id).is_none()
        {
            let who = self.nodes[j].name.clone();
            self.note(&who, format_args!("records {id} from the copy handed out"));
            self.stats.recorded_from_copy += 1;
            if !self.node_append(
                j,
                vec![Event::CallQueued {
                    call: std::sync::Arc::new(spec),
                }],
            ) {
                return None;
            }
        }
        self.start_on(j, id, runner)
    }

    /// The finish of `id` by `runner`, recorded by node `j` (as `Calls::finish`): the call as
    /// recorded afterwards, or `None` when `j` crashed on its write.
    fn finish_on(
        &mut self,
        j: usize,
        id: &str,
        runner: &str,
        success: bool,
    ) -> Option<(CallStatus, String)> {
        let before = self.node_state(j).calls.get(id).map(|c| c.status);
        let outcome = if success {
            ebb_core::event::Outcome::Success
        } else {
            ebb_core::event::Outcome::Error
        };
        if let Some(event) = decide_finish(
            &self.node_state(j).calls,
            id.to_owned(),
            runner,
            outcome,
            None,
            format!("run by {runner}: {outcome:?}"),
        ) {
            if before.is_some_and(CallStatus::is_final) {
                self.violate(
                    "finish_idempotent",
                    format!(
                        "a second finish of call {id} was recorded (it was already {before:?})"
                    ),
                );
            }
            if !self.node_append(j, vec![event]) {
                return None;
            }
        }
        let _ = self.queue().delete(vec![id.to_owned()]).now_or_never();
        // The answer: the call as recorded (the first finish's outcome and log).
        let answer = self
            .node_state(j)
            .calls
            .get(id)
            .map_or((CallStatus::Error, String::new()), |c| {
                (c.status, c.log.clone())
            });
        match self.finish_answers.get(id) {
            Some(first) if *first != answer => {
                let first = first.clone();
                self.violate(
                    "finish_idempotent",
                    format!("finish of call {id} answered {answer:?}, earlier {first:?}"),
                );
            }
            Some(_) => {}
            None => {
                self.finish_answers.insert(id.to_owned(), answer.clone());
            }
        }
        Some(answer)
    }

    /// The runner API's semantics on node `k` (as `calls::Calls` has them), on the production
    /// decisions; what another node owns is decided by that node (forwarded), and while it is
    /// down nobody decides for it.
    fn serve_node(&mut self, k: usize, from: usize, req: &NodeReq, attempt: u32) -> NodeAnswer {
        let c = self.sc.calls.clone().expect("calls scenario");
        let queue = self.queue();
        let now = self.now;
        let runner = self.runner_name(from);
        if from != PRODUCER {
            self.nodes[k].heard.insert(runner.clone(), now);
        }
        let back = now + ebb_core::ids::RETRY_AFTER_S * 1000;
        match req {
            NodeReq::Enqueue(spec) => {
                let message = message_of(spec);
                match queue.put(vec![message]).now_or_never() {
                    // A retried enqueue finds its message already there.
                    Some(Ok(())) | Some(Err(ebb_core::queue::QueueError::Duplicate(_))) => {}
                    _ => return NodeAnswer::Down,
                }
                // Recorded a moment later: the message may be read in between. A stalled
                // owner records it much later.
                let lat = if self.strikes(self.faults.owner_stall_chance) {
                    let stall = self.draw(self.faults.owner_stall_ms);
                    let who = self.nodes[k].name.clone();
                    self.note(
                        &who,
                        format_args!("stalls {stall} ms before recording {}", spec.id),
                    );
                    stall
                } else {
                    self.latency()
                };
                let epoch = self.nodes[k].epoch;
                self.at(
                    lat,
                    Action::EnqueueRecord(k, epoch, (**spec).clone(), attempt),
                );
                NodeAnswer::Pending
            }
            NodeReq::Dequeue { max } => {
                let messages = queue
                    .reserve(&runner, *max, std::time::Duration::ZERO)
                    .now_or_never()
                    .and_then(Result::ok)
                    .unwrap_or_default();
                let mut jobs = Vec::new();
                let mut done = Vec::new();
                let mut holds = Vec::new();
                for m in messages {
                    let deliveries = m.deliveries;
                    let Some(spec) = spec_of(&m) else {
                        done.push(m.id);
                        continue;
                    };
                    let own = self.decides(k, &spec.id);
                    // The node whose log says what became of the call: this one, or the owner
                    // (asked, as `Calls::hand_out_foreign` does).
                    let j = if own { k } else { self.owner_node(&spec.id) };
                    if !self.nodes[j].up {
                        holds.push((spec.id, back));
                        continue;
                    }
                    let status = self.node_state(j).calls.get(&spec.id).map(|c| c.status);
                    match status {
                        None if own => {
                            if !self.node_append(
                                k,
                                vec![Event::CallQueued {
                                    call: std::sync::Arc::new(spec.clone()),
                                }],
                            ) {
                                return NodeAnswer::Down;
                            }
                            jobs.push(spec);
                        }
                        // Put by its owner, not recorded yet: held back a moment (as
                        // `Calls::hand_out_foreign`).
                        None => match ebb_core::calls::hold_back_unknown(deliveries, now) {
                            Some(until) => {
                                self.stats.held_unknown += 1;
                                holds.push((spec.id, until));
                            }
                            None => {
                                self.nodes[k]
                                    .handed_unknown
                                    .insert(spec.id.clone(), spec.clone());
                                jobs.push(spec)
                            }
                        },
                        Some(s) if s.is_final() => done.push(spec.id),
                        Some(CallStatus::Running) => {
                            let deadline = self
                                .node_state(j)
                                .calls
                                .get(&spec.id)
                                .and_then(|c| c.deadline_at_ms)
                                .unwrap_or(now);
                            holds.push((spec.id, deadline.max(now) + c.hold_grace_ms));
                        }
                        Some(_) => jobs.push(spec),
                    }
                }
                let _ = queue.hold(holds).now_or_never();
                let _ = queue.delete(done).now_or_never();
                NodeAnswer::Jobs(jobs)
            }
            NodeReq::Start { ids, .. } => {
                let mut verdicts = Vec::new();
                for id in ids {
                    let j = if self.decides(k, id) {
                        k
                    } else {
                        self.owner_node(id)
                    };
                    if j != k {
                        self.stats.forwarded += 1;
                    }
                    let copy = (j != k)
                        .then(|| self.nodes[k].handed_unknown.remove(id))
                        .flatten();
                    let accepted = if self.nodes[j].up {
                        self.start_with_copy(j, id, &runner, copy)
                    } else {
                        None
                    };
                    match accepted {
                        Some(a) => verdicts.push((id.clone(), a)),
                        None if j == k => return NodeAnswer::Down,
                        // The owner is down (or went down deciding): nothing decided here;
                        // the message comes back later.
                        None => {
                            let _ = queue.hold(vec![(id.clone(), back)]).now_or_never();
                            verdicts.push((id.clone(), false));
                        }
                    }
                }
                NodeAnswer::Started(verdicts)
            }
            NodeReq::Finish { id, success, .. } => {
                let j = if self.decides(k, id) {
                    k
                } else {
                    self.owner_node(id)
                };
                if j != k {
                    self.stats.forwarded += 1;
                }
                if !self.nodes[j].up {
                    return NodeAnswer::Down;
                }
                match self.finish_on(j, id, &runner, *success) {
                    Some((status, log)) => NodeAnswer::Finished(status, log),
                    None => NodeAnswer::Down,
                }
            }
        }
    }

    fn node_reply(&mut self, to: usize, e: u32, req: NodeReq, answer: NodeAnswer, attempt: u32) {
        if to == PRODUCER {
            if let NodeReq::Enqueue(spec) = req {
                match answer {
                    NodeAnswer::Enqueued => {
                        self.stats.calls += 1;
                        self.acked.push(spec.id);
                    }
                    _ if attempt + 1 < RUNNER_ATTEMPTS => {
                        self.at(200, Action::Enqueue(*spec, attempt + 1));
                    }
                    _ => {}
                }
            }
            return;
        }
        let runner = &self.runners[to];
        if !runner.up || runner.epoch != e {
            return;
        }
        let name = runner.name.clone();
        if matches!(answer, NodeAnswer::Down) && self.nodes.len() > 1 {
            // Its replica did not answer: the runner goes through the Service again, to any
            // replica.
            let node = self.rng.random_range(0..self.nodes.len());
            self.runners[to].node = node;
        }
        let lost =
            !matches!(answer, NodeAnswer::Down) && self.strikes(self.faults.lost_reply_chance);
        match (req, answer) {
            (NodeReq::Dequeue { .. }, NodeAnswer::Jobs(jobs)) if !lost => {
                self.runners[to].polling = false;
                if jobs.is_empty() {
                    let wait = self.rng.random_range(10..=50);
                    self.runners[to].polling = true;
                    self.at(wait, Action::RunnerPoll(to, e));
                    return;
                }
                let c = self.sc.calls.clone().expect("calls");
                if self.strikes(self.faults.runner_crash_chance) {
                    self.note(&name, format_args!("dequeued {} and crashes", jobs.len()));
                    self.crash_runner(to, c.restart_ms);
                    return;
                }
                self.runners[to].busy += jobs.len();
                let ids: Vec<String> = jobs.into_iter().map(|j| j.id).collect();
                if self.strikes(self.faults.duplicate_chance) {
                    self.send(
                        to,
                        NodeReq::Start {
                            ids: ids.clone(),
                            duplicate: true,
                        },
                        0,
                        0,
                    );
                }
                self.send(
                    to,
                    NodeReq::Start {
                        ids,
                        duplicate: false,
                    },
                    0,
                    0,
                );
                self.runners[to].polling = true;
                self.at(0, Action::RunnerPoll(to, e));
            }
            (NodeReq::Dequeue { .. }, _) => {
                self.runners[to].polling = true;
                self.at(200, Action::RunnerPoll(to, e));
            }
            (
                NodeReq::Start {
                    duplicate: true, ..
                },
                _,
            ) => {}
            (NodeReq::Start { ids, .. }, NodeAnswer::Started(verdicts)) if !lost => {
                let c = self.sc.calls.clone().expect("calls");
                let accepted: Vec<String> = verdicts
                    .into_iter()
                    .filter_map(|(id, ok)| ok.then_some(id))
                    .collect();
                let refused = ids.len() - accepted.len();
                self.runners[to].busy = self.runners[to].busy.saturating_sub(refused);
                if !accepted.is_empty() && self.strikes(self.faults.runner_crash_chance) {
                    self.note(
                        &name,
                        format_args!("started {} and crashes", accepted.len()),
                    );
                    self.crash_runner(to, c.restart_ms);
                    return;
                }
                for id in accepted {
                    self.stats.executed += 1;
                    let n = self.executions.entry(id.clone()).or_insert(0);
                    *n += 1;
                    let n = *n;
                    self.note(&name, format_args!("runs call {id}"));
                    if n > 1 {
                        self.violate(
                            "call_at_most_once",
                            format!("call {id} ran {n} times (now on {name})"),
                        );
                        return;
                    }
                    let run = self.draw(c.run_ms);
                    self.at(run, Action::CallDone(to, e, id));
                }
                self.maybe_poll(to);
            }
            (NodeReq::Start { ids, .. }, _) => {
                // No answer: the runner asks again (a start already accepted is refused then,
                // and the call becomes `error`, never runs).
                if attempt + 1 < RUNNER_ATTEMPTS {
                    self.send(
                        to,
                        NodeReq::Start {
                            ids,
                            duplicate: false,
                        },
                        attempt + 1,
                        200,
                    );
                } else {
                    self.runners[to].busy = self.runners[to].busy.saturating_sub(ids.len());
                    self.maybe_poll(to);
                }
            }
            (
                NodeReq::Finish {
                    duplicate: true, ..
                },
                _,
            ) => {}
            (NodeReq::Finish { id, .. }, NodeAnswer::Finished(status, log)) if !lost => {
                self.note(
                    &name,
                    format_args!("finished call {id}: {status:?} ({log})"),
                );
                self.runners[to].busy = self.runners[to].busy.saturating_sub(1);
                self.maybe_poll(to);
            }
            (NodeReq::Finish { id, success, .. }, _) => {
                if attempt + 1 < RUNNER_ATTEMPTS {
                    self.send(
                        to,
                        NodeReq::Finish {
                            id,
                            success,
                            duplicate: false,
                        },
                        attempt + 1,
                        200,
                    );
                } else {
                    self.runners[to].busy = self.runners[to].busy.saturating_sub(1);
                    self.maybe_poll(to);
                }
            }
            (NodeReq::Enqueue(_), _) => {}
        }
    }

    fn maybe_poll(&mut self, i: usize) {
        let r = &self.runners[i];
        if r.up && !r.polling {
            let e = r.epoch;
            self.runners[i].polling = true;
            self.at(0, Action::RunnerPoll(i, e));
        }
    }

    fn runner_poll(&mut self, i: usize, e: u32) {
        let c = self.sc.calls.clone().expect("calls");
        let r = &self.runners[i];
        if !r.up || r.epoch != e {
            return;
        }
        let free = c.capacity.saturating_sub(r.busy);
        if free == 0 {
            self.runners[i].polling = false;
            return;
        }
        self.runners[i].polling = true;
        self.send(i, NodeReq::Dequeue { max: free }, 0, 0);
    }

    fn call_done(&mut self, i: usize, e: u32, id: String) {
        let r = &self.runners[i];
        if !r.up || r.epoch != e {
            return;
        }
        let name = r.name.clone();
        let c = self.sc.calls.clone().expect("calls");
        if self.strikes(self.faults.runner_crash_chance) {
            self.note(
                &name,
                format_args!("ran call {id} and crashes before finishing it"),
            );
            self.crash_runner(i, c.restart_ms);
            return;
        }
        // Most calls succeed; some fail (a finish records either, once).
        let success = self.rng.random_bool(0.9);
        if self.strikes(self.faults.duplicate_chance) {
            self.send(
                i,
                NodeReq::Finish {
                    id: id.clone(),
                    success,
                    duplicate: true,
                },
                0,
                0,
            );
        }
        self.send(
            i,
            NodeReq::Finish {
                id,
                success,
                duplicate: false,
            },
            0,
            0,
        );
    }

    fn crash_runner(&mut self, i: usize, restart_ms: Range) {
        self.stats.crashes += 1;
        let r = &mut self.runners[i];
        r.up = false;
        r.epoch += 1;
        r.busy = 0;
        r.polling = false;
        let t = self.draw(restart_ms);
        self.at(t.max(1), Action::RunnerRestart(i));
    }

    /// Node `k` crashes: a process crash keeps what the kernel had; a machine crash (a torn
    /// write) also loses the embedded queue's unsynced puts and delivery records. With several
    /// nodes the queue is shared (Kafka, nothing lost) and the partitions its runners read move.
    fn crash_node(&mut self, k: usize, machine: bool) {
        self.stats.crashes += 1;
        let shared = self.nodes.len() > 1;
        let node = &mut self.nodes[k];
        node.up = false;
        node.epoch += 1;
        node.handed_unknown.clear();
        node.refused_unknown.clear();
        let queue = self.queue();
        let lost = if machine && !shared {
            queue.machine_crash()
        } else {
            0
        };
        let moved = if shared { queue.rebalance() } else { 0 };
        let who = self.nodes[k].name.clone();
        self.note(
            &who,
            format_args!(
                "crashes ({} crash; {lost} queue messages lost, {moved} read again elsewhere)",
                if machine { "machine" } else { "process" }
            ),
        );
        let t = self.draw(self.faults.restart_ms);
        self.at(t.max(1), Action::NodeRestart(k));
    }

    fn node_restart(&mut self, k: usize) {
        let who = self.nodes[k].name.clone();
        if let Err(why) = self.nodes[k].log.crash_and_recover() {
            self.violate(
                "replay_equals_live",
                format!("{who} cannot replay its log: {why}"),
            );
            return;
        }
        let queue = self.queue();
        let node = &mut self.nodes[k];
        node.up = true;
        node.heard.clear();
        let seq = node.log.state.seq;
        // As `Calls::recover`: queued calls the queue lost go back on it from the log (the
        // embedded queue; a shared one, Kafka, loses no acknowledged put).
        let queued: Vec<std::sync::Arc<CallSpec>> = node
            .log
            .state
            .calls
            .sorted()
            .into_iter()
            .map(|(_, c)| c)
            .filter(|c| c.status == CallStatus::Queued)
            .map(|c| c.spec.clone())
            .collect();
        let n = if self.nodes.len() == 1 {
            let ids: Vec<&str> = queued.iter().map(|c| c.id.as_str()).collect();
            let missing: std::collections::HashSet<String> = queue
                .missing(&ids)
                .unwrap_or_default()
                .into_iter()
                .collect();
            let back: Vec<Message> = queued
                .iter()
                .filter(|c| missing.contains(&c.id))
                .map(|c| message_of(c))
                .collect();
            let n = back.len();
            let _ = queue.put(back).now_or_never();
            n
        } else {
            0
        };
        self.note(
            &who,
            format_args!(
                "restarted from its log (seq {seq}); {n} queued calls put back on the queue"
            ),
        );
    }

    fn expire(&mut self) {
        if self.nodes.is_empty() {
            return;
        }
        self.at(100, Action::Expire);
        if self.now >= T0 + self.sc.duration_ms {
            self.queue().calm();
        }
        for k in 0..self.nodes.len() {
            if self.nodes[k].up {
                self.expire_node(k);
            }
        }
    }

    /// Node `k`'s expiry loop: runners it has not heard from for their lease are gone (their
    /// calls go to others), and its own running calls past their deadline time out.
    fn expire_node(&mut self, k: usize) {
        let now = self.now;
        let lease = self
            .sc
            .calls
            .as_ref()
            .map_or(u64::MAX, |c| c.runner_lease_ms);
        let node = &mut self.nodes[k];
        let gone: Vec<String> = node
            .heard
            .iter()
            .filter(|(_, at)| now.saturating_sub(**at) >= lease)
            .map(|(r, _)| r.clone())
            .collect();
        for r in &gone {
            node.heard.remove(r);
        }
        let queue = self.queue();
        let who = self.nodes[k].name.clone();
        for r in gone {
            self.note(
                &who,
                format_args!("{r} not heard from; its calls go to others"),
            );
            let _ = queue.release(&r).now_or_never();
        }
        let due: Vec<String> = self
            .node_state(k)
            .schedule
            .due_of(ebb_core::state::schedule::DueKind::CallTimeout, now)
            .filter_map(|(_, d)| match d {
                Due::CallTimeout(id) => Some(id.to_string()),
                _ => None,
            })
            .take(1_000)
            .collect();
        if due.is_empty() {
            return;
        }
        let refs: Vec<&str> = due.iter().map(String::as_str).collect();
        let events = decide_timeouts(&self.node_state(k).calls, &refs, now);
        let ids = timed_out(&events);
        if self.node_append(k, events) {
            let _ = queue.delete(ids).now_or_never();
        }
    }

    // -- checks ---------------------------------------------------------------------------------

    fn check_replays(&mut self) {
        for r in 0..self.replicas.len() {
            if !self.replicas[r].up {
                continue;
            }
            if let Err((invariant, why)) = self.replicas[r].log.check_replay() {
                let name = self.replicas[r].name.clone();
                self.violate(invariant, format!("{name}: {why}"));
                return;
            }
        }
        for k in 0..self.nodes.len() {
            let n = &self.nodes[k];
            if n.up
                && let Err((invariant, why)) = n.log.check_replay()
            {
                let who = n.name.clone();
                self.violate(invariant, format!("{who}: {why}"));
                return;
            }
        }
    }

    fn final_checks(&mut self) {
        self.check_replays();
        if self.violation.is_some() {
            return;
        }
        if let Some(&id) = self.open.iter().find(|&&id| {
            matches!(
                self.requests[id].state,
                ReqState::Held | ReqState::Serving | ReqState::Pending
            )
        }) {
            let q = &self.requests[id];
            let what = format!(
                "request {id} ({:?}, arrived {} ms before the end) was never answered",
                q.state,
                self.now - q.arrived
            );
            self.violate("request_not_lost", what);
            return;
        }
        if let Some(node) = self.nodes.iter().find(|n| !n.up) {
            let what = format!("{} is still down at the end", node.name);
            self.violate("call_reaches_final", what);
            return;
        }
        let stuck = self.acked.iter().find(|id| {
            !self.nodes[self.owner_node(id)]
                .log
                .state
                .calls
                .get(id)
                .is_some_and(|c| c.status.is_final())
        });
        if let Some(id) = stuck {
            let status = self.nodes[self.owner_node(id)]
                .log
                .state
                .calls
                .get(id)
                .map(|c| c.status);
            let what = format!(
                "call {id} is {status:?} {} ms after the faults stopped",
                self.sc.settle_ms
            );
            self.violate("call_reaches_final", what);
        }
    }
}

/// A short description of an event for the trace.
fn describe(e: &Event) -> String {
    match e {
        Event::ScaleRequested {
            from, to, reason, ..
        } => format!("{from}->{to} ({reason:?})"),
        Event::ScaledUp { replicas, .. } | Event::ScaledDown { replicas, .. } => {
            format!("{replicas}")
        }
        Event::RequestsSeen {
            count, last_at_ms, ..
        } => format!("{count} last {last_at_ms}"),
        Event::CallQueued { call } => call.id.clone(),
        Event::CallStarted { id, runner, .. } => format!("{id} by {runner}"),
        Event::CallRejected { id, reason, .. } => format!("{id} ({reason:?})"),
        Event::CallFinished { id, outcome, .. } => format!("{id} {outcome:?}"),
        Event::CallTimedOut { id } => id.clone(),
        _ => String::new(),
    }
}
