//! Pacing of the proxy's work on each replica, shared by every proxy thread and both forwarding
//! paths, so that a burst (a cold start releasing every held request at once) never floods an app
//! with more than it can take:
//!
//! * **Requests per replica** (a route's `concurrency`, like Knative's `containerConcurrency`;
//!   0 means no bound): a request takes a slot on the replica its route's traffic policy picks
//!   ([`crate::discovery`]; by default peak EWMA) among those below the bound, and holds it until
//!   its response is done; how the request ended (its latency, a 5xx, a failed connection, the
//!   `X-Runner-Load` its answer reported) is told to the policy when it ends. The route's
//!   [`Picker`] is rebuilt only when its ready list changes. When
//!   every replica is full the request waits, held like a request for a sleeping workload (the
//!   route's hold queue and hold timeout), until the deployment's [`Group`] reports a freed
//!   slot, and takes it.
//! * **Connections being opened per replica** (`max_connecting`): a request that finds no idle
//!   keep-alive connection opens one only while fewer than the replica's window of openings are
//!   being opened; otherwise it waits for whichever comes first, an idle connection coming back
//!   to its thread's pool or a free opening. A connection is being opened from its connect until
//!   it answers (or [`OPEN_SETTLE_MS`] pass), so connections the app has not accepted never
//!   outnumber the window; the window starts at one, grows by one with each connection that
//!   answered up to `max_connecting`, and halves when an attempt goes unanswered. An app with a
//!   small accept backlog is never sent more connections than it takes. Each new connection has
//!   one [`Settling`] timer, on both paths; a request woken by an opening it does not take passes
//!   it on, and every wait looks again each [`RECHECK_MS`].
//! * **Connects are retried quickly** ([`connect`]): an attempt that gets no answer within
//!   `connect_attempt_ms` (the SYN was dropped, typically by a full accept queue) is abandoned and
//!   made again, the bound doubling up to a second, within `connect_timeout_ms` in all; nothing
//!   was sent, so the retry is safe, and the kernel's SYN back-off (1 s, 3 s, 7 s ...) never
//!   applies.
//!
//! Replicas are known by address, deployments by name; both are looked up when a route's ready
//! list changes, never per request, and dropped when no ready list names them.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::discovery::{self, HasInstance, Instance, Outcome, PickAt, Picker};

/// How often a request waiting for a slot or a connection looks again, whatever it was told: a
/// safety net for a freed slot told to a waiter that avoids that replica, and for a task that
/// moved threads, whose thread's pool tells it nothing.
pub const RECHECK_MS: u64 = 50;

/// The longest single connect attempt.
const ATTEMPT_MAX_MS: u64 = 1_000;

/// One replica as every proxy thread sees it.
#[derive(Debug)]
pub struct Replica {
    /// Where it listens.
    pub addr: SocketAddr,
    /// What load balancing learns of it; requests holding a slot on it are its requests under
    /// way.
    inst: Instance,
    /// Connections being opened to it.
    connecting: AtomicU32,
    /// How many may be opened at once (the `max_connecting` of the route that last listed it).
    max_connecting: AtomicU32,
    /// How many may be opened at once now, at most `max_connecting`: it starts at one, grows by
    /// one with each new connection that answered, and halves when a connect attempt goes
    /// unanswered (a full accept queue), the way TCP paces a path it does not know.
    window: AtomicU32,
    /// An opening ended.
    opening_ended: Notify,
}

/// One deployment's replicas as a whole: a slot freed on any of them.
#[derive(Debug, Default)]
pub struct Group {
    slot_freed: Notify,
}

impl Group {
    /// Resolves when a slot on one of the deployment's replicas is freed (or was freed since the
    /// last waiter was woken).
    pub fn slot_freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.slot_freed.notified()
    }
}

/// Every replica and deployment the proxy paces.
#[derive(Debug, Default)]
pub struct Backends {
    replicas: Mutex<HashMap<SocketAddr, Weak<Replica>>>,
    groups: Mutex<HashMap<String, Weak<Group>>>,
}

impl Backends {
    /// The replica at `addr`, created on first use, opened at most `max_connecting` at a time;
    /// a new one is assumed to answer in `default_rtt_ms` until measured.
    pub fn replica(
        &self,
        addr: SocketAddr,
        max_connecting: u32,
        default_rtt_ms: u64,
    ) -> Arc<Replica> {
        let mut map = self.replicas.lock().expect("replicas lock");
        if let Some(r) = map.get(&addr).and_then(Weak::upgrade) {
            r.max_connecting.store(max_connecting, Ordering::Relaxed);
            return r;
        }
        map.retain(|_, r| r.strong_count() > 0);
        let r = Arc::new(Replica {
            addr,
            inst: Instance::new(addr, 1, discovery::now_us(), default_rtt_ms),
            connecting: AtomicU32::new(0),
            max_connecting: AtomicU32::new(max_connecting),
            window: AtomicU32::new(1),
            opening_ended: Notify::new(),
        });
        map.insert(addr, Arc::downgrade(&r));
        r
    }

    /// The replica at `addr` if a ready list names it.
    pub fn find(&self, addr: SocketAddr) -> Option<Arc<Replica>> {
        self.replicas
            .lock()
            .expect("replicas lock")
            .get(&addr)
            .and_then(Weak::upgrade)
    }

    /// Requests under way on the replica at `addr` (0 when no ready list names it).
    pub fn in_flight_at(&self, addr: SocketAddr) -> u32 {
        self.find(addr).map_or(0, |r| r.inst.active())
    }

    /// Every replica with requests under way, and how many (what the replica that decides
    /// scaling on load weighs a scale-down's choice by).
    pub fn busy_replicas(&self) -> BTreeMap<SocketAddr, u32> {
        self.replicas
            .lock()
            .expect("replicas lock")
            .iter()
            .filter_map(|(a, r)| {
                let n = r.upgrade()?.inst.active();
                (n > 0).then_some((*a, n))
            })
            .collect()
    }

    /// The deployment's group, created on first use.
    pub fn group(&self, deployment: &str) -> Arc<Group> {
        let mut map = self.groups.lock().expect("groups lock");
        if let Some(g) = map.get(deployment).and_then(Weak::upgrade) {
            return g;
        }
        map.retain(|_, g| g.strong_count() > 0);
        let g = Arc::new(Group::default());
        map.insert(deployment.to_owned(), Arc::downgrade(&g));
        g
    }
}

/// A replica list with its route's traffic policy.
pub type Ready = Picker<Arc<Replica>>;

impl Backends {
    /// The replicas at `addrs` under `policy`, each opened at most `max_connecting` at a time.
    pub fn ready(
        &self,
        policy: &crate::discovery::Policy,
        addrs: &[SocketAddr],
        max_connecting: u32,
    ) -> Arc<Ready> {
        let replicas = addrs
            .iter()
            .map(|a| self.replica(*a, max_connecting, policy.default_rtt_ms))
            .collect();
        Arc::new(discovery::with_rng(|rng| Ready::new(policy, replicas, rng)))
    }
}

/// A replica list as last read, with the version of what it was read from (an orchestrator's
/// change counter, a discovery generation). Read again with the same replicas, it keeps its
/// picker, and with it a schedule's place.
#[derive(Debug)]
pub struct ReadyCache(std::sync::RwLock<(u64, Arc<Ready>)>);

impl ReadyCache {
    /// A list read at `version`.
    pub fn new(version: u64, ready: Arc<Ready>) -> ReadyCache {
        ReadyCache(std::sync::RwLock::new((version, ready)))
    }

    /// The list if it was read at `version`.
    pub fn at(&self, version: u64) -> Option<Arc<Ready>> {
        let g = self.0.read().expect("ready lock");
        (g.0 == version).then(|| g.1.clone())
    }

    /// The list read at `version`: `addrs` under `policy`.
    pub fn set(
        &self,
        version: u64,
        addrs: &[SocketAddr],
        policy: &crate::discovery::Policy,
        max_connecting: u32,
        backends: &Backends,
    ) -> Arc<Ready> {
        {
            let mut g = self.0.write().expect("ready lock");
            if g.1.items().iter().map(|r| r.addr).eq(addrs.iter().copied()) {
                g.0 = version;
                return g.1.clone();
            }
        }
        let ready = backends.ready(policy, addrs, max_connecting);
        *self.0.write().expect("ready lock") = (version, ready.clone());
        ready
    }
}

impl HasInstance for Replica {
    fn instance(&self) -> &Instance {
        &self.inst
    }
}

/// A request's place on a replica, held until its response is done. Dropped, it tells the
/// policy how the request ended ([`Slot::answered`], [`Slot::failed`]; neither: not a sample).
#[derive(Debug)]
pub struct Slot {
    ready: Arc<Ready>,
    index: usize,
    /// When it was taken, on the pickers' clock.
    started_us: u64,
    /// How the request ended so far ([`encode`]): an atomic, not a lock, on the hot path.
    outcome: AtomicU64,
    /// Told when the slot is freed (only when the route bounds its requests per replica: nobody
    /// waits otherwise).
    group: Option<Arc<Group>>,
}

impl Slot {
    /// The replica's address.
    pub fn addr(&self) -> SocketAddr {
        self.replica().addr
    }

    /// The replica.
    pub fn replica(&self) -> &Arc<Replica> {
        &self.ready.items()[self.index]
    }

    /// The replica answered with `status` (its head arrived now), reporting `load`
    /// (`X-Runner-Load`) if it did. A 5xx counts towards the replica's ejection.
    /// Returns the time from the pick to the answer, in microseconds.
    pub fn answered(&self, status: u16, load: Option<f64>) -> u64 {
        let rtt_us = discovery::now_us().saturating_sub(self.started_us);
        if let Some(l) = load {
            self.replica().inst.set_load_factor(l);
        }
        let outcome = Outcome::Answered {
            rtt_us,
            failed: status >= 500,
        };
        self.outcome.store(encode(outcome), Ordering::Relaxed);
        rtt_us
    }

    /// No answer came: the connection failed or broke.
    pub fn failed(&self) {
        self.outcome
            .store(encode(Outcome::Failed), Ordering::Relaxed);
    }
}

/// An outcome in a word: 0 not a sample, `u64::MAX` failed, else `rtt_us + 1` with bit 62 set
/// for a server error.
fn encode(o: Outcome) -> u64 {
    const RTT: u64 = (1 << 62) - 2;
    match o {
        Outcome::Unmeasured => 0,
        Outcome::Failed => u64::MAX,
        Outcome::Answered { rtt_us, failed } => ((failed as u64) << 62) | (rtt_us.min(RTT) + 1),
    }
}

fn decode(v: u64) -> Outcome {
    match v {
        0 => Outcome::Unmeasured,
        u64::MAX => Outcome::Failed,
        v => Outcome::Answered {
            rtt_us: (v & ((1 << 62) - 1)) - 1,
            failed: v & (1 << 62) != 0,
        },
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let outcome = decode(*self.outcome.get_mut());
        self.ready.report(self.index, outcome, discovery::now_us());
        self.replica().inst.end();
        if let Some(g) = &self.group {
            g.slot_freed.notify_one();
        }
    }
}

/// Takes a slot on the replica `ready`'s policy picks among those other than `avoid` that are
/// below `limit` requests under way (0: no bound).
pub fn take_slot(
    ready: &Arc<Ready>,
    avoid: Option<SocketAddr>,
    limit: u32,
    key: Option<u64>,
    group: &Arc<Group>,
) -> Option<Slot> {
    let at = PickAt {
        now_us: discovery::now_us(),
        key,
    };
    // The slot is taken with a compare-and-swap; a race lost to another thread picks again.
    for _ in 0..8 {
        let i = discovery::with_rng(|rng| {
            ready.pick(&at, rng, |r| {
                Some(r.addr) != avoid && (limit == 0 || r.inst.active() < limit)
            })
        })?;
        if ready.items()[i].inst.try_begin(limit) {
            return Some(Slot {
                ready: ready.clone(),
                index: i,
                started_us: at.now_us,
                outcome: AtomicU64::new(0),
                group: (limit > 0).then(|| group.clone()),
            });
        }
    }
    None
}

/// A connection being opened to a replica: from its connect until it answers (its first
/// response byte) or [`OPEN_SETTLE_MS`] pass, so that connections the app has not accepted yet
/// never outnumber the openings allowed. The opening ends when dropped.
#[derive(Debug)]
pub struct Opening(Arc<Replica>);

/// How long a new connection that has not answered yet keeps its opening: an app busy with a
/// long first request should not hold back the next connections for long.
pub const OPEN_SETTLE_MS: u64 = 100;

impl Opening {
    /// The connection answered (or settled): the replica takes one more opening at a time.
    pub fn answered(self) {
        let r = &self.0;
        let max = r.max_connecting.load(Ordering::Relaxed).max(1);
        let _ = r
            .window
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some((w + 1).min(max))
            });
    }
}

/// A new connection's opening, ended by whichever comes first: [`Settling::answered`] (its first
/// response byte), or a timer after [`OPEN_SETTLE_MS`] (the app took the connection and is only
/// slow to answer); both widen the replica's window. Dropped before either (the exchange failed),
/// it ends the opening without widening the window.
#[derive(Debug)]
pub struct Settling(Option<Arc<Mutex<Option<Opening>>>>);

impl Opening {
    /// Starts the settle timer; see [`Settling`].
    pub fn settling(self) -> Settling {
        let cell = Arc::new(Mutex::new(Some(self)));
        let timer = cell.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(OPEN_SETTLE_MS)).await;
            Settling::end(&timer, true);
        });
        Settling(Some(cell))
    }
}

impl Settling {
    fn end(cell: &Mutex<Option<Opening>>, answered: bool) {
        let opening = cell.lock().expect("opening lock").take();
        if let Some(o) = opening
            && answered
        {
            o.answered();
        }
    }

    /// The connection answered.
    pub fn answered(&self) {
        if let Some(cell) = &self.0 {
            Self::end(cell, true);
        }
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        if let Some(cell) = self.0.take() {
            Self::end(&cell, false);
        }
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        self.0.connecting.fetch_sub(1, Ordering::AcqRel);
        self.0.opening_ended.notify_one();
    }
}

impl Replica {
    /// Openings allowed at once now.
    pub fn window(&self) -> u32 {
        self.window.load(Ordering::Acquire)
    }

    /// A connect attempt went unanswered: half as many openings at a time (at least one).
    pub fn unanswered(&self) {
        let _ = self
            .window
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some((w / 2).max(1))
            });
    }

    /// Starts opening a connection unless as many as allowed are being opened already.
    pub fn try_open(self: &Arc<Self>) -> Option<Opening> {
        let max = self
            .max_connecting
            .load(Ordering::Relaxed)
            .min(self.window.load(Ordering::Acquire))
            .max(1);
        let mut cur = self.connecting.load(Ordering::Acquire);
        loop {
            if cur >= max {
                return None;
            }
            match self.connecting.compare_exchange(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(Opening(self.clone())),
                Err(now) => cur = now,
            }
        }
    }

    /// Tells the next request waiting for an opening that one is free: for a request woken by an
    /// opening's end that did not take it (an idle connection came back first).
    pub fn pass_on_opening(&self) {
        self.opening_ended.notify_one();
    }

    /// Resolves when an opening to this replica ends (or ended since the last waiter woke).
    pub fn opening_ended(&self) -> tokio::sync::futures::Notified<'_> {
        self.opening_ended.notified()
    }
}

/// What a request waiting for a connection to a replica got: an idle one, or a new one with its
/// opening.
pub enum Got<T> {
    Idle(T),
    New(TcpStream, Opening),
}

/// A connection to `replica` for a request, on either path's pool: an idle one `take` gives, a
/// new one opened within the replica's bound on openings, or the first of those to be had
/// (`returned` tells of idle ones coming back), within `timeout_ms` in all. It never opens a
/// connection it will not use. Woken by an opening that ended, a request that takes an idle
/// connection instead passes the news on to the next one waiting for an opening.
pub async fn get_connection<T>(
    replica: &Arc<Replica>,
    returned: &Notify,
    mut take: impl FnMut() -> Option<T>,
    attempt_ms: u64,
    timeout_ms: u64,
) -> io::Result<Got<T>> {
    let get = async {
        let mut told_opening = false;
        loop {
            let came_back = returned.notified();
            let ended = replica.opening_ended();
            tokio::pin!(came_back, ended);
            came_back.as_mut().enable();
            ended.as_mut().enable();
            if let Some(idle) = take() {
                if told_opening {
                    replica.pass_on_opening();
                }
                return Ok(Got::Idle(idle));
            }
            if let Some(opening) = replica.try_open() {
                let stream = connect(replica.addr, attempt_ms, timeout_ms, Some(replica)).await?;
                return Ok(Got::New(stream, opening));
            }
            told_opening = tokio::select! {
                () = came_back => false,
                () = ended => true,
                () = tokio::time::sleep(Duration::from_millis(RECHECK_MS)) => false,
            };
        }
    };
    within(timeout_ms, "getting a connection", get).await
}

/// How the general path's hops ([`super::h1hop`], [`super::h2hop`]) open connections to a
/// replica and how long they keep them.
#[derive(Clone, Copy)]
pub struct Dial<'a> {
    pub attempt_ms: u64,
    pub timeout_ms: u64,
    /// Idle connections kept per replica and thread (HTTP/1.1).
    pub max_idle: usize,
    /// A connection unused this long, with nothing under way on it, is closed (0: never).
    pub idle_timeout_ms: u64,
    /// The largest head (as HPACK counts it) taken from a replica (HTTP/2).
    pub max_header_list_size: u32,
    pub clock: &'a Arc<dyn crate::clock::Clock>,
}

/// Whether a connection's error says the replica went away (closed, reset or refused it): what
/// was sent on it was not processed.
pub fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::BrokenPipe
    )
}

/// Whether a connection's error says the replica went away or cut it off mid-message (an early
/// end of the stream).
pub fn cut_off(e: &io::Error) -> bool {
    gone(e) || e.kind() == io::ErrorKind::UnexpectedEof
}

/// Connects to `addr`, abandoning an attempt that gets no answer within `attempt_ms` (doubling up
/// to a second) and trying again, for at most `timeout_ms` in all. A refusal ends it at once.
/// An unanswered attempt narrows `replica`'s window of openings.
pub async fn connect(
    addr: SocketAddr,
    attempt_ms: u64,
    timeout_ms: u64,
    replica: Option<&Replica>,
) -> io::Result<TcpStream> {
    let attempts = async {
        let mut attempt = Duration::from_millis(attempt_ms.max(1));
        loop {
            if let Ok(r) = tokio::time::timeout(attempt, TcpStream::connect(addr)).await {
                let stream = r?;
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            tracing::debug!(%addr, attempt_ms = attempt.as_millis() as u64, "connect got no answer; trying again");
            if let Some(r) = replica {
                r.unanswered();
            }
            attempt = (attempt * 2).min(Duration::from_millis(ATTEMPT_MAX_MS));
        }
    };
    within(timeout_ms, "connecting", attempts).await
}

/// `work`, or a `TimedOut` error naming `what` once `timeout_ms` pass.
pub async fn within<T>(
    timeout_ms: u64,
    what: &str,
    work: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    tokio::time::timeout(Duration::from_millis(timeout_ms), work)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} timed out after {timeout_ms} ms"),
            ))
        })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A [`Dial`] for the hops' tests: a second an attempt, 10 s in all, 8 idle connections kept.
    pub fn dial(clock: &Arc<dyn crate::clock::Clock>, idle_timeout_ms: u64) -> Dial<'_> {
        Dial {
            attempt_ms: 1_000,
            timeout_ms: 10_000,
            max_idle: 8,
            idle_timeout_ms,
            max_header_list_size: 16 * 1024,
            clock,
        }
    }

    fn ready_list(b: &Backends, n: u16, policy: &crate::discovery::Policy) -> Arc<Ready> {
        let replicas = (0..n)
            .map(|i| b.replica(SocketAddr::from(([127, 0, 0, 1], 1000 + i)), 4, 30))
            .collect();
        Arc::new(discovery::with_rng(|rng| Ready::new(policy, replicas, rng)))
    }

    #[test]
    fn an_outcome_survives_its_word() {
        for o in [
            Outcome::Unmeasured,
            Outcome::Failed,
            Outcome::Answered {
                rtt_us: 0,
                failed: false,
            },
            Outcome::Answered {
                rtt_us: 1_234,
                failed: true,
            },
            Outcome::Answered {
                rtt_us: (1 << 62) - 2,
                failed: true,
            },
        ] {
            assert_eq!(decode(encode(o)), o);
        }
    }

    #[test]
    fn slots_are_taken_within_the_bound_where_the_policy_picks() {
        use crate::discovery::{Balancer, Policy};
        let b = Backends::default();
        let g = b.group("d");
        let ready = ready_list(&b, 3, &Policy::of(Balancer::LeastRequest));
        let held: Vec<Slot> = (0..6)
            .map(|_| take_slot(&ready, None, 2, None, &g).unwrap())
            .collect();
        for r in ready.items() {
            assert_eq!(r.inst.active(), 2, "every replica at its bound");
        }
        assert!(take_slot(&ready, None, 2, None, &g).is_none(), "all full");
        let unbounded = take_slot(&ready, None, 0, None, &g).unwrap();
        drop(unbounded);
        // A freed slot is the only one below the bound: it is taken.
        let freed = held[1].addr();
        let mut held = held;
        held.remove(1);
        let last = take_slot(&ready, None, 2, None, &g).unwrap();
        assert_eq!(last.addr(), freed);
        assert!(take_slot(&ready, None, 2, None, &g).is_none());
        drop(held);
        // The replica to avoid is never picked.
        let avoid = ready.items()[0].addr;
        for _ in 0..20 {
            assert_ne!(
                take_slot(&ready, Some(avoid), 0, None, &g).unwrap().addr(),
                avoid
            );
        }
        let none = ready_list(&b, 0, &Policy::default());
        assert!(take_slot(&none, None, 0, None, &g).is_none());
    }

    #[test]
    fn a_slot_tells_the_policy_how_its_request_ended() {
        use crate::discovery::Policy;
        let b = Backends::default();
        let g = b.group("d");
        let policy = Policy {
            eject_after_failures: 2,
            ..Policy::default()
        };
        let ready = ready_list(&b, 2, &policy);
        let bad = ready.items()[0].addr;
        // Two failures in a row on the first replica eject it: every pick goes to the other.
        for _ in 0..2 {
            let s = take_slot(&ready, Some(ready.items()[1].addr), 0, None, &g).unwrap();
            assert_eq!(s.addr(), bad);
            s.answered(503, Some(0.5));
        }
        assert_eq!(ready.items()[0].inst.load_factor(), Some(0.5));
        for _ in 0..20 {
            assert_ne!(take_slot(&ready, None, 0, None, &g).unwrap().addr(), bad);
        }
    }

    #[test]
    fn openings_are_bounded_and_replicas_forgotten_when_unused() {
        let b = Backends::default();
        let r = b.replica(SocketAddr::from(([127, 0, 0, 1], 9)), 3, 30);
        // One at a time until a connection answers; then one more each, up to the bound.
        let first = r.try_open().unwrap();
        assert!(r.try_open().is_none());
        first.answered();
        let first = r.try_open().unwrap();
        let second = r.try_open().unwrap();
        assert!(r.try_open().is_none());
        second.answered();
        let second = r.try_open().unwrap();
        let third = r.try_open().unwrap();
        assert!(r.try_open().is_none());
        third.answered();
        assert_eq!(r.window(), 3, "never beyond max_connecting");
        // An unanswered attempt halves the window.
        r.unanswered();
        assert_eq!(r.window(), 1);
        drop(first);
        assert!(r.try_open().is_none(), "one is still being opened");
        assert!(Arc::ptr_eq(&b.replica(r.addr, 3, 30), &r));
        let addr = r.addr;
        drop(second);
        drop(r);
        assert!(b.find(addr).is_none());
    }

    #[tokio::test]
    async fn a_refused_connect_fails_at_once_and_a_listening_one_succeeds() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        assert!(connect(addr, 50, 5_000, None).await.is_ok());
        drop(l);
        let e = connect(addr, 50, 5_000, None).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
    }
}
