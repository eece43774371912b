//! In-memory traffic per route: requests in flight (held ones included), requests since the last
//! flush, and the newest request time. The hot path only touches atomics; the flusher turns the
//! counts into `RequestsSeen` aggregates.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Traffic of every route this proxy has served.
#[derive(Debug, Default)]
pub struct Traffic {
    routes: RwLock<HashMap<String, Arc<RouteTraffic>>>,
}

/// One route's traffic.
#[derive(Debug, Default)]
pub struct RouteTraffic {
    in_flight: AtomicU64,
    held: AtomicU32,
    requests: AtomicU64,
    /// Requests taken by the flusher so far (with `requests`: every request since the start).
    flushed: AtomicU64,
    last_at_ms: AtomicU64,
    waking: std::sync::atomic::AtomicBool,
}

/// Marks a wake of the route under way until dropped.
#[derive(Debug)]
pub struct Waking(Arc<RouteTraffic>);

impl Drop for Waking {
    fn drop(&mut self) {
        self.0.waking.store(false, Ordering::Release);
    }
}

/// Counts a request as in flight until dropped.
#[derive(Debug)]
pub struct InFlight(Arc<RouteTraffic>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts a request as held until dropped.
#[derive(Debug)]
pub struct Held(Arc<RouteTraffic>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Traffic {
    /// The route's counters, created on first use.
    pub fn route(&self, name: &str) -> Arc<RouteTraffic> {
        if let Some(r) = self.routes.read().expect("traffic lock").get(name) {
            return r.clone();
        }
        self.routes
            .write()
            .expect("traffic lock")
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    /// Every route's counters.
    pub fn all(&self) -> Vec<(String, Arc<RouteTraffic>)> {
        self.routes
            .read()
            .expect("traffic lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

impl RouteTraffic {
    /// A request arrived at `now_ms`.
    pub fn begin(self: &Arc<Self>, now_ms: u64) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.last_at_ms.fetch_max(now_ms, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// Holds a request, unless `max` are held already.
    pub fn hold(self: &Arc<Self>, max: u32) -> Option<Held> {
        let prev = self.held.fetch_add(1, Ordering::AcqRel);
        let held = Held(self.clone());
        (prev < max).then_some(held)
    }

    /// Starts a wake unless one is under way.
    pub fn begin_wake(self: &Arc<Self>) -> Option<Waking> {
        self.waking
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then(|| Waking(self.clone()))
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The newest request time seen.
    pub fn last_at_ms(&self) -> u64 {
        self.last_at_ms.load(Ordering::Relaxed)
    }

    /// Requests held now.
    pub fn held(&self) -> u32 {
        self.held.load(Ordering::Acquire)
    }

    /// Every request since the start (a counter; read without touching the hot path).
    pub fn served(&self) -> u64 {
        self.flushed.load(Ordering::Acquire) + self.requests.load(Ordering::Acquire)
    }

    /// Takes the count of requests since the last call, with the newest request time.
    pub fn take_requests(&self) -> (u64, u64) {
        let n = self.requests.swap(0, Ordering::AcqRel);
        self.flushed.fetch_add(n, Ordering::AcqRel);
        (n, self.last_at_ms.load(Ordering::Relaxed))
    }

    /// Puts back requests whose flush failed.
    pub fn restore_requests(&self, count: u64) {
        self.requests.fetch_add(count, Ordering::Relaxed);
        self.flushed.fetch_sub(count, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_count_and_bound() {
        let t = Traffic::default();
        let r = t.route("a");
        let a = r.begin(10);
        let b = r.begin(5);
        assert_eq!(r.in_flight(), 2);
        drop(a);
        assert_eq!(r.in_flight(), 1);
        drop(b);
        assert_eq!(r.served(), 2);
        assert_eq!(r.take_requests(), (2, 10));
        assert_eq!(r.take_requests(), (0, 10));
        assert_eq!(r.served(), 2, "flushed requests still count");
        r.restore_requests(2);
        assert_eq!(r.served(), 2, "and restored ones once");
        let h1 = r.hold(1);
        assert!(h1.is_some());
        assert!(r.hold(1).is_none(), "the second hold is over the bound");
        drop(h1);
        assert!(r.hold(1).is_some());
        let w = r.begin_wake();
        assert!(w.is_some());
        assert!(r.begin_wake().is_none(), "one wake at a time");
        drop(w);
        assert!(r.begin_wake().is_some());
        assert!(Arc::ptr_eq(&t.route("a"), &r));
    }
}
