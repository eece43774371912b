//! Time as an input. Everything in ebb that needs the time asks a [`Clock`]; this is the only module
//! that reads the operating system's clocks (`clippy.toml` forbids `SystemTime::now` and
//! `Instant::now` everywhere else). Projections never read a clock at all: the time of an event is
//! the `at_ms` of its envelope.
//!
//! [`SystemClock`] is the real one; [`SimClock`] moves only when told; [`SkewedClock`] is a
//! [`SimClock`] off by a fixed skew (a simulated replica's clock); [`Stopwatch`] measures
//! elapsed time on the monotonic clock (benchmarks, the load balancers' clock, cache ages).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in Unix milliseconds.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The operating system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to: the simulator's and the tests' clock.
#[derive(Debug, Clone, Default)]
pub struct SimClock {
    now_ms: Arc<AtomicU64>,
}

impl SimClock {
    /// A simulated clock starting at `start_ms`.
    pub fn new(start_ms: u64) -> Self {
        Self {
            now_ms: Arc::new(AtomicU64::new(start_ms)),
        }
    }

    /// Moves the clock forward by `by_ms`.
    pub fn advance(&self, by_ms: u64) {
        self.now_ms.fetch_add(by_ms, Ordering::SeqCst);
    }

    /// Sets the clock; it may move backwards, as a skewed clock would.
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for SimClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

/// Measures elapsed wall time, for benchmarks and progress output only — never for decisions.
/// One replica's clock in the simulator: a shared [`SimClock`] off by a fixed skew.
#[derive(Debug, Clone)]
pub struct SkewedClock {
    base: SimClock,
    skew_ms: i64,
}

impl SkewedClock {
    /// `base` off by `skew_ms` (either way).
    pub fn new(base: SimClock, skew_ms: i64) -> Self {
        Self { base, skew_ms }
    }
}

impl Clock for SkewedClock {
    fn now_ms(&self) -> u64 {
        self.base.now_ms().saturating_add_signed(self.skew_ms)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Stopwatch(Instant);

impl Stopwatch {
    /// Starts measuring now.
    pub fn start() -> Self {
        Self(Instant::now())
    }

    /// Time since [`Stopwatch::start`].
    pub fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_clock_moves_only_when_told() {
        let c = SimClock::new(1_000);
        assert_eq!(c.now_ms(), 1_000);
        c.advance(250);
        assert_eq!(c.now_ms(), 1_250);
        c.set(10);
        assert_eq!(c.now_ms(), 10);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }
}
