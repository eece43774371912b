//! Load balancing: a [`Picker`] is a [`Policy`] applied to one list of instances.
//!
//! * Each instance ([`Instance`]) carries what the balancers read: its weight, when it was first
//!   seen (slow start), requests under way, a peak-EWMA latency estimate, its last reported load
//!   factor, and its failures and ejections. These live as long as the instance is known, across
//!   rebuilds of the picker when the list changes.
//! * A pick takes the caller's clock (`now_us`), the request's hash key (consistent hashing), a
//!   random number generator handed in (seeded: the same seed picks the same instances) and a
//!   filter (`usable`: not at the route's concurrency bound, not the one just refused). Only
//!   instances the filter keeps and that are not ejected are picked, unless so many are ejected
//!   that the panic threshold applies. A sampled choice that the filter refuses is sampled again
//!   a few times and then replaced by a scan, so a pick ends whatever the instance count (unlike a
//!   power-of-choices loop waiting for distinct choices among too few instances).
//! * Nothing here expands instances into a list by weight: weighted random draws from prefix
//!   sums, smooth weighted round robin runs an earliest-deadline-first schedule, Maglev fills a
//!   table of a fixed prime size.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use rand::RngCore;

use super::policy::{Balancer, Policy};

/// Load factors are kept in thousandths.
const LOAD_SCALE: f64 = 1_000.0;
/// No load factor reported.
const NO_LOAD: u32 = u32::MAX;
/// How many sampled choices a filter may refuse before a pick scans instead.
const RESAMPLES: usize = 4;
/// Ejections lengthen up to this many times `ejection_ms`.
const MAX_EJECTION_FACTOR: u64 = 10;
/// Most instances a consistent-hash pick walks past when the key's own is not usable.
const HASH_WALK: usize = 64;

/// One instance of a service, with what the balancers learn of it.
#[derive(Debug)]
pub struct Instance {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its relative share of requests (at least 1).
    pub weight: u32,
    /// When it was first seen, on the pickers' clock (slow start counts from here).
    pub added_us: u64,
    active: AtomicU32,
    /// Peak EWMA: the estimate (nanoseconds, an `f64`'s bits) and when it was last updated.
    rtt_ns: AtomicU64,
    rtt_at_us: AtomicU64,
    /// The last reported load factor, in thousandths ([`NO_LOAD`]: none).
    load: AtomicU32,
    failures: AtomicU32,
    ejections: AtomicU32,
    ejected_until_us: AtomicU64,
}

impl Instance {
    /// An instance first seen at `added_us`, assumed to answer in `default_rtt_ms` until measured.
    pub fn new(addr: SocketAddr, weight: u32, added_us: u64, default_rtt_ms: u64) -> Instance {
        Instance {
            addr,
            weight: weight.max(1),
            added_us,
            active: AtomicU32::new(0),
            rtt_ns: AtomicU64::new((default_rtt_ms as f64 * 1e6).to_bits()),
            rtt_at_us: AtomicU64::new(added_us),
            load: AtomicU32::new(NO_LOAD),
            failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until_us: AtomicU64::new(0),
        }
    }

    /// Requests under way.
    pub fn active(&self) -> u32 {
        self.active.load(Ordering::Acquire)
    }

    /// Counts one more request under way, unless `limit` (0: none) are under way already.
    pub fn try_begin(&self, limit: u32) -> bool {
        let mut cur = self.active.load(Ordering::Acquire);
        loop {
            if limit > 0 && cur >= limit {
                return false;
            }
            match self.active.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// A request counted by [`Instance::try_begin`] ended.
    pub fn end(&self) {
        self.active.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether it is ejected at `now_us`.
    pub fn ejected(&self, now_us: u64) -> bool {
        self.ejected_until_us.load(Ordering::Relaxed) > now_us
    }

    /// The peak-EWMA latency estimate at `now_us`, in nanoseconds: the last estimate decayed
    /// towards zero for the time since (so an instance not tried for a while is tried again).
    pub fn rtt_estimate_ns(&self, now_us: u64, decay_us: f64) -> f64 {
        let est = f64::from_bits(self.rtt_ns.load(Ordering::Relaxed));
        let at = self.rtt_at_us.load(Ordering::Relaxed);
        let elapsed = now_us.saturating_sub(at) as f64;
        est * (-elapsed / decay_us).exp()
    }

    /// Takes a measured latency into the estimate: a slower one at once (the peak), a faster
    /// one in proportion to the time since the last update.
    fn observe_rtt(&self, rtt_ns: f64, now_us: u64, decay_us: f64) {
        let est = f64::from_bits(self.rtt_ns.load(Ordering::Relaxed));
        let at = self.rtt_at_us.load(Ordering::Relaxed);
        let next = if rtt_ns > est {
            rtt_ns
        } else {
            let decay = (-(now_us.saturating_sub(at) as f64) / decay_us).exp();
            est * decay + rtt_ns * (1.0 - decay)
        };
        self.rtt_ns.store(next.to_bits(), Ordering::Relaxed);
        self.rtt_at_us.store(now_us, Ordering::Relaxed);
    }

    /// The last load factor it reported (`in_flight / capacity`).
    pub fn load_factor(&self) -> Option<f64> {
        let l = self.load.load(Ordering::Relaxed);
        (l != NO_LOAD).then(|| l as f64 / LOAD_SCALE)
    }

    /// Records a load factor it reported.
    pub fn set_load_factor(&self, load: f64) {
        if load.is_finite() && load >= 0.0 {
            let l = (load * LOAD_SCALE).min((NO_LOAD - 1) as f64) as u32;
            self.load.store(l, Ordering::Relaxed);
        }
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }
}

/// Parses `X-Runner-Load: in_flight/capacity` (or a bare factor) into a load factor.
pub fn parse_load(value: &[u8]) -> Option<f64> {
    let s = std::str::from_utf8(value).ok()?.trim();
    match s.split_once('/') {
        Some((a, b)) => {
            let (a, b): (f64, f64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
            (b > 0.0 && a >= 0.0).then(|| a / b)
        }
        None => s.parse().ok().filter(|f: &f64| *f >= 0.0 && f.is_finite()),
    }
}

/// How a request sent to an instance ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// It answered after `rtt_us`; `failed`: with a 5xx (counted towards ejection).
    Answered {
        /// Time to the answer's head.
        rtt_us: u64,
        /// A server error.
        failed: bool,
    },
    /// No answer: the connection failed or broke.
    Failed,
    /// Not a sample: the request was abandoned, or its exchange was not a request-response
    /// (an upgraded connection).
    Unmeasured,
}

/// What a pick knows of its request.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickAt {
    /// The pickers' clock, in microseconds.
    pub now_us: u64,
    /// The request's hash key (consistent hashing); `None`: placed at random.
    pub key: Option<u64>,
}

/// Whatever holds an instance (the proxy's replicas hold theirs with connection state).
pub trait HasInstance {
    /// The instance.
    fn instance(&self) -> &Instance;
}

impl HasInstance for Instance {
    fn instance(&self) -> &Instance {
        self
    }
}

impl<T: HasInstance> HasInstance for std::sync::Arc<T> {
    fn instance(&self) -> &Instance {
        (**self).instance()
    }
}

/// A uniform index below `n` (Lemire's multiply-shift; its bias of at most `n / 2^64` is far
/// below anything a test could see).
fn below(rng: &mut impl RngCore, n: usize) -> usize {
    ((rng.next_u64() as u128 * n as u128) >> 64) as usize
}

/// A uniform float in `[0, 1)`.
pub fn unit(rng: &mut impl RngCore) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The smooth weighted round robin's schedule: each instance's next turn, earliest first.
#[derive(Debug)]
struct Edf {
    /// (deadline's bits, order of insertion, index): deadlines are non-negative, so their bits
    /// order as they do.
    heap: BinaryHeap<Reverse<(u64, u64, u32)>>,
    now: f64,
    seq: u64,
}

impl Edf {
    fn push(&mut self, deadline: f64, i: usize) {
        self.seq += 1;
        self.heap
            .push(Reverse((deadline.max(0.0).to_bits(), self.seq, i as u32)));
    }
}

#[derive(Debug)]
enum Kind {
    /// Uniformly at random: nothing kept.
    Random,
    /// A power-of-choices balancer (least request, min load, peak EWMA): nothing kept.
    Choices(Balancer),
    RoundRobin(AtomicUsize),
    /// Weighted random: the running sums of the weights.
    Prefix(Vec<u64>),
    Edf(Mutex<Edf>),
    /// Maglev's lookup table.
    Maglev(Vec<u32>),
}

/// Instances ejected now, so that a pick knows in O(1) whether any are and whether the panic
/// threshold applies.
#[derive(Debug, Default)]
struct Ejected {
    /// (until, index).
    list: Mutex<Vec<(u64, usize)>>,
    count: AtomicU32,
    /// The earliest `until` in the list (u64::MAX: none).
    next_end_us: AtomicU64,
}

/// A policy applied to one list of instances.
#[derive(Debug)]
pub struct Picker<T> {
    policy: Policy,
    items: Vec<T>,
    kind: Kind,
    /// Slow start applies before this (0: to no instance).
    slow_until_us: u64,
    /// Every instance has the same weight.
    uniform: bool,
    ejected: Ejected,
    decay_us: f64,
}

impl<T: HasInstance> Picker<T> {
    /// The picker of `policy` over `items`; `rng` places the schedule's first turns.
    pub fn new(policy: &Policy, items: Vec<T>, rng: &mut impl RngCore) -> Picker<T> {
        let inst = |i: usize| items[i].instance();
        let n = items.len();
        let uniform = items
            .windows(2)
            .all(|w| w[0].instance().weight == w[1].instance().weight);
        let kind = match policy.balancer {
            Balancer::RoundRobin => {
                Kind::RoundRobin(AtomicUsize::new(if n > 0 { below(rng, n) } else { 0 }))
            }
            Balancer::WeightedRandom => {
                let mut sum = 0u64;
                Kind::Prefix(
                    (0..n)
                        .map(|i| {
                            sum += inst(i).weight as u64;
                            sum
                        })
                        .collect(),
                )
            }
            Balancer::WeightedRoundRobin => {
                let mut edf = Edf {
                    heap: BinaryHeap::with_capacity(n),
                    now: 0.0,
                    seq: 0,
                };
                for i in 0..n {
                    edf.push(unit(rng) / inst(i).weight as f64, i);
                }
                Kind::Edf(Mutex::new(edf))
            }
            Balancer::ConsistentHash => Kind::Maglev(maglev(&items)),
            Balancer::Random => Kind::Random,
            b @ (Balancer::LeastRequest | Balancer::MinLoad | Balancer::PeakEwma) => {
                Kind::Choices(b)
            }
        };
        let slow_until_us = if policy.slow_start_ms == 0 {
            0
        } else {
            (0..n)
                .map(|i| inst(i).added_us + policy.slow_start_ms * 1_000)
                .max()
                .unwrap_or(0)
        };
        let picker = Picker {
            policy: policy.clone(),
            kind,
            slow_until_us,
            uniform,
            ejected: Ejected {
                list: Mutex::new(Vec::new()),
                count: AtomicU32::new(0),
                next_end_us: AtomicU64::new(u64::MAX),
            },
            decay_us: policy.ewma_decay_ms as f64 * 1_000.0,
            items,
        };
        // Instances still ejected from before the list changed stay ejected.
        {
            let mut list = picker.ejected.list.lock().expect("ejected lock");
            for (i, it) in picker.items.iter().enumerate() {
                let until = it.instance().ejected_until_us.load(Ordering::Relaxed);
                if until > 0 {
                    list.push((until, i));
                }
            }
            picker.ejected.recount(&mut list, 0);
        }
        picker
    }

    /// The instances.
    pub fn items(&self) -> &[T] {
        &self.items
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    fn inst(&self, i: usize) -> &Instance {
        self.items[i].instance()
    }

    /// Slow start's share of an instance's weight at `now_us` (1: full).
    pub fn slow_start_factor(&self, i: usize, now_us: u64) -> f64 {
        if now_us >= self.slow_until_us {
            return 1.0;
        }
        let window = self.policy.slow_start_ms as f64 * 1_000.0;
        let age = now_us.saturating_sub(self.inst(i).added_us) as f64;
        if age >= window {
            return 1.0;
        }
        let f = (age / window).powf(100.0 / self.policy.slow_start_aggression_percent as f64);
        f.max(self.policy.slow_start_min_percent as f64 / 100.0)
            .min(1.0)
    }

    /// An instance's weight as a pick sees it at `now_us` (slow start applied).
    fn weight(&self, i: usize, now_us: u64) -> f64 {
        self.inst(i).weight as f64 * self.slow_start_factor(i, now_us)
    }

    /// Whether ejections are ignored now: too few instances are left (the panic threshold).
    fn panicking(&self, now_us: u64) -> bool {
        let count = self.ejected.count.load(Ordering::Acquire);
        if count == 0 {
            return false;
        }
        let count = if now_us >= self.ejected.next_end_us.load(Ordering::Acquire) {
            let mut list = self.ejected.list.lock().expect("ejected lock");
            self.ejected.recount(&mut list, now_us)
        } else {
            count
        };
        let n = self.items.len() as u64;
        count > 0 && (n - count as u64) * 100 < n * self.policy.panic_threshold_percent as u64
    }

    /// Picks an instance among those `usable` keeps (and that are not ejected, unless the panic
    /// threshold applies). `None`: none is usable.
    pub fn pick(
        &self,
        at: &PickAt,
        rng: &mut impl RngCore,
        usable: impl Fn(&T) -> bool,
    ) -> Option<usize> {
        let n = self.items.len();
        if n == 0 {
            return None;
        }
        let now = at.now_us;
        let any_ejected = self.ejected.count.load(Ordering::Acquire) > 0 && !self.panicking(now);
        let ok = |i: usize| {
            let it = &self.items[i];
            usable(it) && !(any_ejected && it.instance().ejected(now))
        };
        let slow = now < self.slow_until_us;
        match &self.kind {
            Kind::RoundRobin(next) => {
                for _ in 0..n {
                    let i = next.fetch_add(1, Ordering::Relaxed) % n;
                    if ok(i) && (!slow || unit(rng) < self.slow_start_factor(i, now)) {
                        return Some(i);
                    }
                }
                self.scan(rng, &ok)
            }
            Kind::Prefix(sums) => {
                for _ in 0..RESAMPLES {
                    let i = if slow {
                        self.draw_weighted_now(rng, now)
                    } else {
                        let total = *sums.last().expect("not empty");
                        let x = ((rng.next_u64() as u128 * total as u128) >> 64) as u64;
                        sums.partition_point(|&s| s <= x)
                    };
                    if ok(i) {
                        return Some(i);
                    }
                }
                self.scan(rng, &ok)
            }
            Kind::Edf(edf) => {
                let mut edf = edf.lock().expect("edf lock");
                let mut skipped: Vec<usize> = Vec::new();
                let mut got = None;
                while let Some(Reverse((d, _, i))) = edf.heap.pop() {
                    let i = i as usize;
                    let deadline = f64::from_bits(d);
                    if ok(i) {
                        edf.now = deadline;
                        edf.push(deadline + 1.0 / self.weight(i, now), i);
                        got = Some(i);
                        break;
                    }
                    skipped.push(i);
                }
                // Those passed over lose this turn rather than catch up in a burst later.
                for i in skipped {
                    let d = edf.now + 1.0 / self.weight(i, now);
                    edf.push(d, i);
                }
                got
            }
            Kind::Maglev(table) => {
                let Some(key) = at.key else {
                    return self.random(rng, &ok, slow, now);
                };
                let m = table.len();
                let start = (key % m as u64) as usize;
                for step in 0..HASH_WALK.min(m) {
                    let i = table[(start + step) % m] as usize;
                    if ok(i) {
                        return Some(i);
                    }
                }
                self.scan(rng, &ok)
            }
            Kind::Random => self.random(rng, &ok, slow, now),
            Kind::Choices(b) => self.choices(*b, rng, &ok, now),
        }
    }

    fn random(
        &self,
        rng: &mut impl RngCore,
        ok: &impl Fn(usize) -> bool,
        slow: bool,
        now: u64,
    ) -> Option<usize> {
        let n = self.items.len();
        for _ in 0..RESAMPLES {
            let i = below(rng, n);
            if ok(i) && (!slow || unit(rng) < self.slow_start_factor(i, now)) {
                return Some(i);
            }
        }
        self.scan(rng, ok)
    }

    /// A weighted draw with every weight as slow start makes it now (O(n): only while an
    /// instance is starting).
    fn draw_weighted_now(&self, rng: &mut impl RngCore, now: u64) -> usize {
        let n = self.items.len();
        let total: f64 = (0..n).map(|i| self.weight(i, now)).sum();
        let mut x = unit(rng) * total;
        for i in 0..n {
            x -= self.weight(i, now);
            if x < 0.0 {
                return i;
            }
        }
        n - 1
    }

    /// The score of the power-of-choices balancers: lower wins.
    fn score(&self, b: Balancer, i: usize, now: u64) -> f64 {
        let it = self.inst(i);
        let active = it.active() as f64;
        let raw = match b {
            Balancer::LeastRequest => {
                if self.uniform && self.slow_until_us <= now {
                    return active;
                }
                let bias = self.policy.active_request_bias_percent;
                if bias == 100 {
                    active + 1.0
                } else {
                    (active + 1.0).powf(bias as f64 / 100.0)
                }
            }
            Balancer::MinLoad => match it.load_factor() {
                // The reported load first, then requests under way among equals.
                Some(l) => l * LOAD_SCALE + active / LOAD_SCALE,
                None => active * LOAD_SCALE,
            },
            _ => it.rtt_estimate_ns(now, self.decay_us) * (active + 1.0),
        };
        raw / self.weight(i, now)
    }

    fn choices(
        &self,
        b: Balancer,
        rng: &mut impl RngCore,
        ok: &impl Fn(usize) -> bool,
        now: u64,
    ) -> Option<usize> {
        let n = self.items.len();
        let k = (self.policy.choices as usize).clamp(1, n);
        let mut best: Option<(f64, usize)> = None;
        for _ in 0..RESAMPLES {
            if k == 2 {
                // The common case without a buffer: two distinct indices.
                let a = below(rng, n);
                let mut c = below(rng, n - 1);
                if c >= a {
                    c += 1;
                }
                for i in [a, c] {
                    if ok(i) {
                        let s = self.score(b, i, now);
                        if best.is_none_or(|(bs, _)| s < bs) {
                            best = Some((s, i));
                        }
                    }
                }
            } else {
                // Floyd's sampling of k distinct indices.
                let mut picked = [0usize; 16];
                for (m, j) in (n - k..n).enumerate() {
                    let t = below(rng, j + 1);
                    let i = if picked[..m].contains(&t) { j } else { t };
                    picked[m] = i;
                    if ok(i) {
                        let s = self.score(b, i, now);
                        if best.is_none_or(|(bs, _)| s < bs) {
                            best = Some((s, i));
                        }
                    }
                }
            }
            if let Some((_, i)) = best {
                return Some(i);
            }
        }
        // Every choice refused: the best of all usable ones.
        (0..n)
            .filter(|&i| ok(i))
            .map(|i| (self.score(b, i, now), i))
            .min_by(|x, y| x.0.total_cmp(&y.0))
            .map(|(_, i)| i)
    }

    /// The first usable instance from a random place.
    fn scan(&self, rng: &mut impl RngCore, ok: &impl Fn(usize) -> bool) -> Option<usize> {
        let n = self.items.len();
        let start = below(rng, n);
        (0..n).map(|k| (start + k) % n).find(|&i| ok(i))
    }

    /// Takes how a request to instance `i` ended into its estimate, its failures in a row and,
    /// past `eject_after_failures`, its ejection.
    pub fn report(&self, i: usize, outcome: Outcome, now_us: u64) {
        let it = self.inst(i);
        let failed = match outcome {
            Outcome::Answered { rtt_us, failed } => {
                it.observe_rtt(rtt_us as f64 * 1_000.0, now_us, self.decay_us);
                failed
            }
            Outcome::Failed => true,
            Outcome::Unmeasured => return,
        };
        if !failed {
            it.failures.store(0, Ordering::Relaxed);
            return;
        }
        let failures = it.failures.fetch_add(1, Ordering::Relaxed) + 1;
        let limit = self.policy.eject_after_failures;
        if limit == 0 || failures < limit || it.ejected(now_us) {
            return;
        }
        let n = self.items.len();
        let max = ((n * self.policy.max_ejection_percent as usize) / 100).max(1);
        let mut list = self.ejected.list.lock().expect("ejected lock");
        let count = self.ejected.recount(&mut list, now_us) as usize;
        if count >= max {
            return;
        }
        let times = it.ejections.fetch_add(1, Ordering::Relaxed) as u64 + 1;
        let until = now_us + self.policy.ejection_ms * 1_000 * times.min(MAX_EJECTION_FACTOR);
        it.ejected_until_us.store(until, Ordering::Relaxed);
        it.failures.store(0, Ordering::Relaxed);
        list.push((until, i));
        self.ejected.recount(&mut list, now_us);
        tracing::info!(addr = %it.addr, failures, until_ms = until / 1_000, "instance ejected after failures in a row");
    }

    /// Instances ejected at `now_us`.
    pub fn ejected_count(&self, now_us: u64) -> usize {
        let mut list = self.ejected.list.lock().expect("ejected lock");
        self.ejected.recount(&mut list, now_us) as usize
    }
}

impl Ejected {
    /// Drops the ejections over by `now_us`; returns how many are left.
    fn recount(&self, list: &mut Vec<(u64, usize)>, now_us: u64) -> u32 {
        list.retain(|&(until, _)| until > now_us);
        let next = list.iter().map(|&(u, _)| u).min().unwrap_or(u64::MAX);
        self.next_end_us.store(next, Ordering::Release);
        self.count.store(list.len() as u32, Ordering::Release);
        list.len() as u32
    }
}

/// A stable 64-bit hash (FNV-1a, then mixed): the same on every replica and every run.
pub fn hash_key(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h)
}

/// A 64-bit finaliser (splitmix64's), so nearby inputs spread over the whole range.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The Maglev table's size for `n` instances: a prime at least 65,537 and 100 times `n` at most
/// (so shares stay within about one per cent of their weight), capped for very large sets.
fn maglev_size(n: usize) -> usize {
    let want = (n * 100).clamp(65_537, 1_000_003);
    (want..)
        .find(|&c| (2..).take_while(|d| d * d <= c).all(|d| c % d != 0))
        .expect("a prime exists")
}

/// Maglev's lookup table (Eisenbud et al., 2016), weighted as Envoy does: each round, an
/// instance takes its next preferred free slot only when its weight has earned it one.
fn maglev<T: HasInstance>(items: &[T]) -> Vec<u32> {
    let n = items.len();
    if n == 0 {
        return Vec::new();
    }
    let m = maglev_size(n);
    let max_w = items
        .iter()
        .map(|t| t.instance().weight as u64)
        .max()
        .unwrap_or(1);
    struct Entry {
        offset: u64,
        skip: u64,
        next: u64,
        weight: u64,
        target: u64,
    }
    let mut entries: Vec<Entry> = items
        .iter()
        .map(|t| {
            let name = t.instance().addr.to_string();
            let h = hash_key(name.as_bytes());
            let h2 = mix(h ^ 0x9e37_79b9_7f4a_7c15);
            Entry {
                offset: h % m as u64,
                skip: h2 % (m as u64 - 1) + 1,
                next: 0,
                weight: t.instance().weight as u64,
                target: 0,
            }
        })
        .collect();
    let mut table = vec![u32::MAX; m];
    let mut filled = 0;
    let mut round: u64 = 0;
    while filled < m {
        for (i, e) in entries.iter_mut().enumerate() {
            if filled == m {
                break;
            }
            if round * e.weight < e.target {
                continue;
            }
            e.target += max_w;
            loop {
                let c = ((e.offset + e.next * e.skip) % m as u64) as usize;
                e.next += 1;
                if table[c] == u32::MAX {
                    table[c] = i as u32;
                    filled += 1;
                    break;
                }
            }
        }
        round += 1;
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn instances(weights: &[u32]) -> Vec<Instance> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                Instance::new(
                    SocketAddr::from(([127, 0, 0, 1], 10_000 + i as u16)),
                    w,
                    0,
                    30,
                )
            })
            .collect()
    }

    fn counts(p: &Picker<Instance>, picks: usize, seed: u64) -> Vec<usize> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut c = vec![0; p.items().len()];
        for k in 0..picks {
            let at = PickAt {
                now_us: 1_000_000,
                key: Some(hash_key(&k.to_le_bytes())),
            };
            c[p.pick(&at, &mut rng, |_| true).unwrap()] += 1;
        }
        c
    }

    /// Each share within `tolerance` (a fraction of the expected share) of its weight's.
    fn assert_shares(c: &[usize], weights: &[u32], tolerance: f64, what: &str) {
        let total: usize = c.iter().sum();
        let wsum: u32 = weights.iter().sum();
        for (i, (&got, &w)) in c.iter().zip(weights).enumerate() {
            let want = total as f64 * w as f64 / wsum as f64;
            let off = (got as f64 - want).abs() / want;
            assert!(
                off <= tolerance,
                "{what}: instance {i} (weight {w}) got {got} of {total}, expected {want:.0} (off by {:.1}%)",
                off * 100.0
            );
        }
    }

    #[test]
    fn weights_are_respected_within_tolerance_over_100_000_picks() {
        let weights = [1, 2, 3, 4, 10];
        for b in [
            Balancer::WeightedRandom,
            Balancer::WeightedRoundRobin,
            Balancer::ConsistentHash,
        ] {
            let mut policy = Policy::of(b);
            policy.hash_on = Some(super::super::policy::HashOn::Path);
            let mut rng = ChaCha8Rng::seed_from_u64(7);
            let p = Picker::new(&policy, instances(&weights), &mut rng);
            let c = counts(&p, 100_000, 1);
            // Random draws: 5 % of the smallest share (about 4 standard deviations);
            // the schedule is exact to one pick.
            let tol = match b {
                Balancer::WeightedRoundRobin => 0.001,
                _ => 0.05,
            };
            assert_shares(&c, &weights, tol, b.name());
        }
        // Unweighted: every instance an equal share.
        for b in [Balancer::Random, Balancer::RoundRobin] {
            let mut rng = ChaCha8Rng::seed_from_u64(7);
            let p = Picker::new(&Policy::of(b), instances(&[1; 8]), &mut rng);
            let c = counts(&p, 100_000, 2);
            assert_shares(&c, &[1; 8], 0.05, b.name());
        }
    }

    #[test]
    fn smooth_weighted_round_robin_never_runs_more_than_one_beyond_its_share() {
        for (seed, weights) in [
            (1, vec![1, 1]),
            (2, vec![5, 1, 1]),
            (3, vec![3, 2, 1]),
            (4, vec![10, 1]),
            (5, vec![7, 3, 3, 2, 1, 1]),
        ] {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let p = Picker::new(
                &Policy::of(Balancer::WeightedRoundRobin),
                instances(&weights),
                &mut rng,
            );
            let total: u32 = weights.iter().sum();
            let mut run = (usize::MAX, 0usize);
            for _ in 0..10_000 {
                let i = p.pick(&PickAt::default(), &mut rng, |_| true).unwrap();
                run = if run.0 == i { (i, run.1 + 1) } else { (i, 1) };
                // Its share of a run between the others' turns: weight / (total - weight).
                let w = weights[i];
                let share = (w as f64 / (total - w) as f64).ceil() as usize;
                assert!(
                    run.1 <= share + 1,
                    "{weights:?}: instance {i} picked {} times in a row (share {share})",
                    run.1
                );
            }
        }
    }

    #[test]
    fn power_of_choices_avoid_a_busy_slow_or_loaded_instance() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        // Least request: instance 0 has 10 requests under way.
        let p = Picker::new(
            &Policy::of(Balancer::LeastRequest),
            instances(&[1; 4]),
            &mut rng,
        );
        for _ in 0..10 {
            assert!(p.items()[0].try_begin(0));
        }
        let c = counts(&p, 10_000, 4);
        assert_eq!(c[0], 0, "never preferred over an idle one: {c:?}");
        // Peak EWMA: instance 1 answered in 2 s, the others in 1 ms.
        let p = Picker::new(
            &Policy::of(Balancer::PeakEwma),
            instances(&[1; 4]),
            &mut rng,
        );
        for (i, rtt_us) in [(0, 1_000), (1, 2_000_000), (2, 1_000), (3, 1_000)] {
            p.report(
                i,
                Outcome::Answered {
                    rtt_us,
                    failed: false,
                },
                1_000_000,
            );
        }
        let c = counts(&p, 10_000, 5);
        assert_eq!(c[1], 0, "{c:?}");
        // Min load: instance 2 reports itself full.
        let p = Picker::new(&Policy::of(Balancer::MinLoad), instances(&[1; 4]), &mut rng);
        for (i, it) in p.items().iter().enumerate() {
            it.set_load_factor(if i == 2 { 1.0 } else { 0.1 });
        }
        let c = counts(&p, 10_000, 6);
        assert_eq!(c[2], 0, "{c:?}");
        assert_eq!(parse_load(b"3/4"), Some(0.75));
        assert_eq!(parse_load(b"0.5"), Some(0.5));
        assert_eq!(parse_load(b"1/0"), None);
        assert_eq!(parse_load(b"x"), None);
    }

    #[test]
    fn choices_are_clamped_and_a_pick_ends_when_few_or_none_are_usable() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for b in Balancer::ALL {
            let mut policy = Policy::of(b);
            policy.choices = 16;
            policy.hash_on = Some(super::super::policy::HashOn::Path);
            for n in [0, 1, 2, 3] {
                let p = Picker::new(&policy, instances(&vec![1; n]), &mut rng);
                let at = PickAt {
                    now_us: 0,
                    key: Some(42),
                };
                if n == 0 {
                    assert_eq!(p.pick(&at, &mut rng, |_| true), None);
                    continue;
                }
                assert!(p.pick(&at, &mut rng, |_| true).is_some(), "{b:?} {n}");
                // Only the last instance usable: it is found; none usable: None.
                let last = p.items()[n - 1].addr;
                assert_eq!(
                    p.pick(&at, &mut rng, |it| it.addr == last),
                    Some(n - 1),
                    "{b:?} {n}"
                );
                assert_eq!(p.pick(&at, &mut rng, |_| false), None, "{b:?} {n}");
            }
        }
    }

    #[test]
    fn failing_instances_are_ejected_for_a_while_within_the_bound_and_panic_ignores_ejection() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let policy = Policy {
            balancer: Balancer::RoundRobin,
            eject_after_failures: 3,
            ejection_ms: 1_000,
            max_ejection_percent: 50,
            panic_threshold_percent: 60,
            ..Policy::default()
        };
        let p = Picker::new(&policy, instances(&[1; 4]), &mut rng);
        let at = |now_us| PickAt { now_us, key: None };
        p.report(0, Outcome::Failed, 0);
        p.report(0, Outcome::Failed, 0);
        p.report(
            0,
            Outcome::Answered {
                rtt_us: 5,
                failed: false,
            },
            0,
        );
        p.report(0, Outcome::Failed, 0);
        p.report(0, Outcome::Failed, 0);
        assert_eq!(p.ejected_count(0), 0, "a success resets the count");
        p.report(
            0,
            Outcome::Answered {
                rtt_us: 5,
                failed: true,
            },
            0,
        );
        assert_eq!(p.ejected_count(0), 1);
        for _ in 0..100 {
            assert_ne!(p.pick(&at(10), &mut rng, |_| true), Some(0));
        }
        // Ejected for ejection_ms; back afterwards.
        assert!((0..8).any(|_| p.pick(&at(1_000_001), &mut rng, |_| true) == Some(0)));
        // Second ejection lasts twice as long.
        for _ in 0..3 {
            p.report(0, Outcome::Failed, 2_000_000);
        }
        assert!(p.items()[0].ejected(3_500_000));
        assert!(!p.items()[0].ejected(4_000_001));
        // At most half of the instances: a third failing one is not ejected.
        for i in [1, 2] {
            for _ in 0..3 {
                p.report(i, Outcome::Failed, 2_000_000);
            }
        }
        assert_eq!(p.ejected_count(2_000_000), 2);
        // Two of four ejected: 50 % left, under the 60 % panic threshold: all are picked.
        let mut seen = [false; 4];
        for _ in 0..8 {
            seen[p.pick(&at(2_000_001), &mut rng, |_| true).unwrap()] = true;
        }
        assert_eq!(seen, [true; 4]);
        // A rebuilt picker keeps the ejections.
        let items: Vec<Instance> = instances(&[1; 4]);
        items[3]
            .ejected_until_us
            .store(9_000_000, Ordering::Relaxed);
        let q = Picker::new(&policy, items, &mut rng);
        assert_eq!(q.ejected_count(2_000_000), 1);
    }

    #[test]
    fn slow_start_gives_a_new_instance_a_growing_share() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let policy = Policy {
            balancer: Balancer::WeightedRandom,
            slow_start_ms: 10_000,
            slow_start_min_percent: 10,
            ..Policy::default()
        };
        let mut items = instances(&[1, 1]);
        items[1] = Instance::new(items[1].addr, 1, 100_000_000, 30);
        let p = Picker::new(&policy, items, &mut rng);
        let share = |now_us: u64, rng: &mut ChaCha8Rng| {
            let at = PickAt { now_us, key: None };
            (0..20_000)
                .filter(|_| p.pick(&at, rng, |_| true) == Some(1))
                .count() as f64
                / 20_000.0
        };
        // Just added: its floor (10 % of its weight): 0.1 / 1.1.
        assert!((share(100_000_000, &mut rng) - 0.1 / 1.1).abs() < 0.02);
        // Half way: half its weight.
        assert!((share(105_000_000, &mut rng) - 0.5 / 1.5).abs() < 0.02);
        // After the window: an equal share.
        assert!((share(111_000_000, &mut rng) - 0.5).abs() < 0.02);
    }

    #[test]
    fn consistent_hashing_keeps_keys_in_place_and_moves_few_when_an_instance_goes() {
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        let mut policy = Policy::of(Balancer::ConsistentHash);
        policy.hash_on = Some(super::super::policy::HashOn::Path);
        let all = instances(&[1; 10]);
        let addrs: Vec<SocketAddr> = all.iter().map(|i| i.addr).collect();
        let p = Picker::new(&policy, all, &mut rng);
        let fewer = Picker::new(&policy, instances(&[1; 9]), &mut rng);
        let (mut moved, mut others) = (0, 0);
        for k in 0..10_000u64 {
            let at = PickAt {
                now_us: 0,
                key: Some(hash_key(&k.to_le_bytes())),
            };
            let a = p.pick(&at, &mut rng, |_| true).unwrap();
            assert_eq!(p.pick(&at, &mut rng, |_| true), Some(a), "stable");
            let b = fewer.pick(&at, &mut rng, |_| true).unwrap();
            if addrs[a] != fewer.items()[b].addr {
                if a == 9 {
                    moved += 1;
                } else {
                    others += 1;
                }
            }
        }
        // About a tenth of the keys were on the removed instance; of the others' keys, Maglev
        // moves very few (its paper: minimal disruption, not none).
        assert!((800..1_200).contains(&moved), "{moved}");
        assert!(
            others < 200,
            "{others} keys of the remaining instances moved"
        );
        // A key whose instance is not usable goes to another, the same one each time.
        let at = PickAt {
            now_us: 0,
            key: Some(5),
        };
        let a = p.pick(&at, &mut rng, |_| true).unwrap();
        let b = p.pick(&at, &mut rng, |it| it.addr != addrs[a]).unwrap();
        assert_ne!(a, b);
        assert_eq!(p.pick(&at, &mut rng, |it| it.addr != addrs[a]), Some(b));
    }

    #[test]
    fn the_same_seed_picks_the_same_instances() {
        for b in Balancer::ALL {
            let mut policy = Policy::of(b);
            policy.hash_on = Some(super::super::policy::HashOn::Path);
            let run = || {
                let mut rng = ChaCha8Rng::seed_from_u64(99);
                let p = Picker::new(&policy, instances(&[1, 2, 3, 4, 5]), &mut rng);
                (0..100)
                    .map(|_| p.pick(&PickAt::default(), &mut rng, |_| true).unwrap())
                    .collect::<Vec<_>>()
            };
            assert_eq!(run(), run(), "{b:?}");
        }
    }
}
