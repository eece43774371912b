//! The simulated call queue: the [`Queue`] contract in memory, on simulated time, with
//! reservation timeouts, redelivery and (as a fault) duplicate delivery of a message another
//! runner holds. Every operation answers at once; the simulator adds the network around it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use ebb_core::clock::{Clock, SimClock};
use ebb_core::queue::{Message, Queue, QueueError, QueueFuture, QueueStats};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Out {
    Ready,
    Reserved { runner: String, until: u64 },
    Held { until: u64 },
}

#[derive(Debug, Clone)]
struct Entry {
    message: Message,
    out: Out,
}

struct Inner {
    now_ms: u64,
    next: u64,
    entries: BTreeMap<u64, Entry>,
    by_id: HashMap<String, u64>,
    rng: ChaCha8Rng,
    duplicate_chance: f64,
}

/// The queue.
pub struct SimQueue {
    inner: Mutex<Inner>,
    clock: SimClock,
    visibility_ms: u64,
}

impl SimQueue {
    /// An empty queue.
    pub fn new(clock: SimClock, seed: u64, visibility_ms: u64, duplicate_chance: f64) -> Self {
        Self {
            clock,
            inner: Mutex::new(Inner {
                now_ms: 0,
                next: 0,
                entries: BTreeMap::new(),
                by_id: HashMap::new(),
                rng: ChaCha8Rng::seed_from_u64(seed),
                duplicate_chance,
            }),
            visibility_ms,
        }
    }

    /// The state, with the time read from the simulated clock.
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        let mut g = self.inner.lock().expect("sim queue lock");
        g.now_ms = self.clock.now_ms();
        g
    }

    /// Stops duplicate deliveries (faults are over).
    pub fn calm(&self) {
        self.lock().duplicate_chance = 0.0;
    }

    /// A machine crash: the embedded queue writes puts and delivery records unsynced, so any of
    /// them may be gone. Each message is lost with even chance; the survivors' deliveries are
    /// forgotten (ready again). Returns how many were lost.
    pub fn machine_crash(&self) -> usize {
        let mut g = self.lock();
        let seqs: Vec<u64> = g.entries.keys().copied().collect();
        let mut lost = 0;
        for n in seqs {
            if g.rng.random_bool(0.5) {
                if let Some(e) = g.entries.remove(&n) {
                    g.by_id.remove(&e.message.id);
                }
                lost += 1;
            } else if let Some(e) = g.entries.get_mut(&n) {
                e.out = Out::Ready;
            }
        }
        lost
    }

    /// A rebalance of a shared queue (Kafka): the partitions move between consumers, and the
    /// new consumer of a partition reads again every message not yet deleted, held or not
    /// (holds live in the memory of the replica that read the message). Each message handed out
    /// is anyone's again with even chance. Returns how many.
    pub fn rebalance(&self) -> usize {
        let mut g = self.lock();
        let seqs: Vec<u64> = g
            .entries
            .iter()
            .filter(|(_, e)| e.out != Out::Ready)
            .map(|(n, _)| *n)
            .collect();
        let mut moved = 0;
        for n in seqs {
            if g.rng.random_bool(0.5)
                && let Some(e) = g.entries.get_mut(&n)
            {
                e.out = Out::Ready;
                moved += 1;
            }
        }
        moved
    }

    /// Messages on the queue.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether the queue is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Queue for SimQueue {
    fn put(&self, messages: Vec<Message>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut g = self.lock();
            for m in &messages {
                if g.by_id.contains_key(&m.id) {
                    return Err(QueueError::Duplicate(m.id.clone()));
                }
            }
            for m in messages {
                let n = g.next;
                g.next += 1;
                g.by_id.insert(m.id.clone(), n);
                g.entries.insert(
                    n,
                    Entry {
                        message: m,
                        out: Out::Ready,
                    },
                );
            }
            Ok(())
        })
    }

    fn reserve(&self, runner: &str, max: usize, _wait: Duration) -> QueueFuture<'_, Vec<Message>> {
        let runner = runner.to_owned();
        Box::pin(async move {
            let mut g = self.lock();
            let now = g.now_ms;
            for e in g.entries.values_mut() {
                match e.out {
                    Out::Reserved { until, .. } | Out::Held { until } if until <= now => {
                        e.out = Out::Ready;
                    }
                    _ => {}
                }
            }
            // Its own partition's messages first, then those meant for any runner.
            let mut picked: Vec<u64> = Vec::new();
            for own in [true, false] {
                for (&n, e) in &g.entries {
                    if picked.len() >= max {
                        break;
                    }
                    let wanted = if own {
                        e.message.partition == runner
                    } else {
                        e.message.partition.is_empty()
                    };
                    if e.out == Out::Ready && wanted {
                        picked.push(n);
                    }
                }
            }
            // The fault: a message another runner holds is handed out again.
            let dup = g.duplicate_chance;
            if dup > 0.0 && g.rng.random_bool(dup) {
                let other = g
                    .entries
                    .iter()
                    .find(
                        |(_, e)| matches!(&e.out, Out::Reserved { runner: r, .. } if *r != runner),
                    )
                    .map(|(n, _)| *n);
                if let Some(n) = other {
                    picked.push(n);
                }
            }
            let until = now + self.visibility_ms;
            let mut out = Vec::with_capacity(picked.len());
            for n in picked {
                if let Some(e) = g.entries.get_mut(&n) {
                    e.out = Out::Reserved {
                        runner: runner.clone(),
                        until,
                    };
                    e.message.deliveries += 1;
                    out.push(e.message.clone());
                }
            }
            Ok(out)
        })
    }

    fn hold(&self, holds: Vec<(String, u64)>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut g = self.lock();
            for (id, until) in holds {
                if let Some(n) = g.by_id.get(&id).copied()
                    && let Some(e) = g.entries.get_mut(&n)
                {
                    e.out = Out::Held { until };
                }
            }
            Ok(())
        })
    }

    fn delete(&self, ids: Vec<String>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut g = self.lock();
            for id in ids {
                if let Some(n) = g.by_id.remove(&id) {
                    g.entries.remove(&n);
                }
            }
            Ok(())
        })
    }

    fn release(&self, runner: &str) -> QueueFuture<'_, ()> {
        let runner = runner.to_owned();
        Box::pin(async move {
            let mut g = self.lock();
            for e in g.entries.values_mut() {
                if matches!(&e.out, Out::Reserved { runner: r, .. } if *r == runner) {
                    e.out = Out::Ready;
                }
                if e.message.partition == runner {
                    e.message.partition.clear();
                }
            }
            Ok(())
        })
    }

    fn missing(&self, ids: &[&str]) -> Option<Vec<String>> {
        let g = self.lock();
        Some(
            ids.iter()
                .filter(|id| !g.by_id.contains_key(**id))
                .map(|id| id.to_string())
                .collect(),
        )
    }

    fn owners(&self) -> Vec<String> {
        let g = self.lock();
        let mut owners: Vec<String> = g
            .entries
            .values()
            .filter_map(|e| match &e.out {
                Out::Reserved { runner, .. } => Some(runner.clone()),
                _ => None,
            })
            .collect();
        owners.sort();
        owners.dedup();
        owners
    }

    fn stats(&self) -> QueueStats {
        let g = self.lock();
        let ready = g.entries.values().filter(|e| e.out == Out::Ready).count();
        QueueStats {
            ready,
            reserved: g.entries.len() - ready,
            ..QueueStats::default()
        }
    }
}
