//! Service discovery and load balancing: whenever ebb sends a request (the proxy to a workload's
//! replicas, a runner to a function, one ebb replica to another) it resolves a service to its
//! instances and picks one.
//!
//! * [`ServiceId`]: a URI naming a service (`http://host:port`, `conf://name`,
//!   `k8s://service.namespace:port`, `k8s-env://name`, `ebb://app`).
//! * [`Policy`]: which load balancer picks, with slow start, outlier ejection and a panic
//!   threshold; [`Picker`]: a policy applied to one list of [`Instance`]s.
//! * [`Discovery`]: what resolves a service id to its instances and keeps them current, one per
//!   kind of source: [`dns::Dns`] (`http`, `https`, `ws`, `wss`) here, a Service's EndpointSlices
//!   (`k8s`, watched) and its environment variables (`k8s-env`) in ebb-kube; [`Composite`]
//!   chooses one by scheme, [`Cache`] shares each watched service.
//!   Meta services (`conf`, [`meta`]) and ebb's own workloads (`ebb`) are resolved by the proxy
//!   from the configuration and the orchestrator.
//!
//! The module is a library: it records no events. What it decides per request (which instance)
//! is not a decision of the log; what it learns (latency, load, failures) lives in memory with
//! the instance.
//!
//! [`Discovery::watch`] gives a `watch::Receiver<Resolved>` whose generation counter readers
//! compare to rebuild their picker only when the instances changed. [`Cache`] keeps one watch per
//! service id, shared by every destination that names it. The pickers' monotonic clock
//! ([`now_us`]) and the per-thread seeded generators ([`with_rng`], [`set_seed`]) are here too.
//! The policies, balancers, service ids and meta services are the core's (`ebb_core::discovery`),
//! re-exported here.

pub mod client;
pub mod dns;

pub use client::{Balanced, Chosen, PickError};
pub use ebb_core::discovery::*;

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::watch;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::clock::Stopwatch;

/// A service's instances as last resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Counts the changes of `addrs` (0: not resolved yet). Whoever picks instances rebuilds its
    /// picker when it moved: instances no longer listed get no new requests, and the requests
    /// under way on them finish (they hold the old picker): the old instances drain.
    pub generation: u64,
    /// The instances, sorted.
    pub addrs: Vec<SocketAddr>,
    /// Why the last resolution failed, if it did (the instances are the last good ones).
    pub error: Option<String>,
}

/// Publishes `addrs` as `id`'s instances: a new generation if they changed (or were never
/// published); a past error cleared.
pub fn publish(tx: &watch::Sender<Resolved>, id: &ServiceId, mut addrs: Vec<SocketAddr>) {
    addrs.sort();
    addrs.dedup();
    tx.send_if_modified(|r| {
        let changed = r.addrs != addrs || r.generation == 0;
        if changed {
            if r.generation > 0 {
                tracing::info!(service = %id, from = ?r.addrs, to = ?addrs, "instances changed");
            }
            r.generation += 1;
            r.addrs = addrs;
        }
        let had_error = r.error.take().is_some();
        changed || had_error
    });
}

/// Resolves service ids of some schemes and keeps them current.
pub trait Discovery: Send + Sync {
    /// The schemes it resolves.
    fn schemes(&self) -> Vec<&'static str>;

    /// Starts keeping `id` resolved (a task of the current runtime): the receiver sees every
    /// change. `Err`: the id cannot be resolved by this source at all.
    fn watch(&self, id: &ServiceId) -> Result<watch::Receiver<Resolved>, String>;
}

/// Discovery services by scheme.
#[derive(Default)]
pub struct Composite {
    by_scheme: Vec<(&'static str, Arc<dyn Discovery>)>,
}

impl Composite {
    /// Adds a source for its schemes (a scheme already served keeps its first source).
    pub fn with(mut self, d: Arc<dyn Discovery>) -> Composite {
        for s in d.schemes() {
            if !self.by_scheme.iter().any(|(t, _)| *t == s) {
                self.by_scheme.push((s, d.clone()));
            }
        }
        self
    }

    /// The schemes it resolves.
    pub fn schemes(&self) -> Vec<&'static str> {
        self.by_scheme.iter().map(|(s, _)| *s).collect()
    }

    /// Whether it resolves `id`'s scheme.
    pub fn supports(&self, id: &ServiceId) -> bool {
        self.by_scheme.iter().any(|(s, _)| *s == id.scheme())
    }
}

impl Discovery for Composite {
    fn schemes(&self) -> Vec<&'static str> {
        Composite::schemes(self)
    }

    fn watch(&self, id: &ServiceId) -> Result<watch::Receiver<Resolved>, String> {
        match self.by_scheme.iter().find(|(s, _)| *s == id.scheme()) {
            Some((_, d)) => d.watch(id),
            None => Err(format!(
                "{id}: no discovery for the scheme {:?} here (known: {})",
                id.scheme(),
                self.schemes().join(", ")
            )),
        }
    }
}

/// Most services a [`Cache`] keeps.
pub const MAX_SERVICES: usize = 10_000;

/// Watched services shared by everyone who asks for them: one watch (one refresh task, one
/// Kubernetes watch) per service id however many destinations name it.
pub struct Cache {
    source: Arc<dyn Discovery>,
    entries: Mutex<HashMap<ServiceId, Arc<Watched>>>,
}

/// One service of a [`Cache`].
#[derive(Debug)]
pub struct Watched {
    id: ServiceId,
    rx: watch::Receiver<Resolved>,
}

impl Watched {
    /// Its instances now.
    pub fn get(&self) -> Resolved {
        self.rx.borrow().clone()
    }

    /// The generation now (no copy).
    pub fn generation(&self) -> u64 {
        self.rx.borrow().generation
    }

    /// Waits (at most `limit`) until it was resolved once, or failed to be.
    pub async fn first(&self, limit: std::time::Duration) -> Resolved {
        {
            let now = self.rx.borrow();
            if now.generation > 0 || now.error.is_some() {
                return now.clone();
            }
        }
        let mut rx = self.rx.clone();
        let _ = tokio::time::timeout(
            limit,
            rx.wait_for(|r| r.generation > 0 || r.error.is_some()),
        )
        .await;
        self.get()
    }

    /// A receiver of its changes.
    pub fn changes(&self) -> watch::Receiver<Resolved> {
        self.rx.clone()
    }

    /// Its id.
    pub fn id(&self) -> &ServiceId {
        &self.id
    }
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("schemes", &self.source.schemes())
            .finish()
    }
}

impl Cache {
    /// A cache over `source`.
    pub fn new(source: Arc<dyn Discovery>) -> Cache {
        Cache {
            source,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The service `id`, watched from its first request on.
    pub fn get(&self, id: &ServiceId) -> Result<Arc<Watched>, String> {
        let mut entries = self.entries.lock().expect("cache lock");
        if let Some(e) = entries.get(id) {
            return Ok(e.clone());
        }
        if entries.len() >= MAX_SERVICES {
            return Err(format!("{id}: {MAX_SERVICES} services are watched already"));
        }
        let rx = self.source.watch(id)?;
        let e = Arc::new(Watched { id: id.clone(), rx });
        entries.insert(id.clone(), e.clone());
        Ok(e)
    }
}

/// The pickers' clock: microseconds since the first reading in this process (monotonic).
pub fn now_us() -> u64 {
    static EPOCH: OnceLock<Stopwatch> = OnceLock::new();
    // Starts at one second so that "never" (0) is always in the past.
    EPOCH.get_or_init(Stopwatch::start).elapsed().as_micros() as u64 + 1_000_000
}

/// The seed of the threads' generators (0: not set, drawn at random on first use).
static SEED: AtomicU64 = AtomicU64::new(0);
/// Threads whose generator was seeded so far: each thread's seed is the seed and its number.
static THREADS: AtomicU64 = AtomicU64::new(0);

/// Seeds every generator made from now on (`--seed`): the same seed and the same order of
/// threads make the same picks.
pub fn set_seed(seed: u64) {
    SEED.store(seed.max(1), Ordering::Relaxed);
}

/// Runs `f` with this thread's generator.
pub fn with_rng<R>(f: impl FnOnce(&mut ChaCha8Rng) -> R) -> R {
    thread_local! {
        static RNG: RefCell<ChaCha8Rng> = RefCell::new(thread_rng());
    }
    RNG.with(|r| f(&mut r.borrow_mut()))
}

fn thread_rng() -> ChaCha8Rng {
    let mut seed = SEED.load(Ordering::Relaxed);
    if seed == 0 {
        // The standard library's per-process random keys: no seed asked for, a random one.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0);
        seed = h.finish().max(1);
        let _ = SEED.compare_exchange(0, seed, Ordering::Relaxed, Ordering::Relaxed);
        seed = SEED.load(Ordering::Relaxed);
    }
    let n = THREADS.fetch_add(1, Ordering::Relaxed);
    ChaCha8Rng::seed_from_u64(seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_makes_the_threads_generators_repeatable() {
        use rand::RngCore;
        let first = thread_rng().next_u64();
        let second = thread_rng().next_u64();
        assert_ne!(first, second, "each thread its own stream");
        assert!(now_us() >= 1_000_000);
    }
}
