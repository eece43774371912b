//! Picking instances for ebb's own clients (the runners sending calls to functions served
//! elsewhere, a runner reaching ebb's API, one replica forwarding to another): a [`Balanced`] keeps
//! one [`Picker`] per watched service, rebuilt when discovery's generation moves (instances still
//! listed keep what was learnt of them), and hands out [`Chosen`] instances that report how their
//! request ended (or, dropped without a report, only end their count of requests under way).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{
    Cache, Instance, Outcome, PickAt, Picker, Policy, ServiceId, Watched, now_us, with_rng,
};
use crate::clock::Stopwatch;

/// One service's picker, with the generation it was built at.
struct Entry {
    generation: u64,
    policy: Policy,
    picker: Arc<Picker<Arc<Instance>>>,
}

/// Instances of services resolved through a [`Cache`], picked by policy.
pub struct Balanced {
    cache: Arc<Cache>,
    entries: Mutex<HashMap<ServiceId, Entry>>,
}

impl std::fmt::Debug for Balanced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balanced")
            .field("cache", &self.cache)
            .finish()
    }
}

/// Why no instance was picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    /// The id cannot be resolved here (an unknown scheme, a bad shape, too many services).
    #[error("{0}")]
    Unresolvable(String),
    /// It resolved to no instance (yet), or every one is busy or ejected.
    #[error("{0}")]
    NoInstance(String),
}

/// An instance picked for one request. Dropped without `Chosen::report`, the request is not a
/// sample (only its count under way ends).
pub struct Chosen {
    picker: Arc<Picker<Arc<Instance>>>,
    index: usize,
    began: Stopwatch,
    reported: bool,
}

impl std::fmt::Debug for Chosen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chosen")
            .field("addr", &self.addr())
            .finish()
    }
}

impl Chosen {
    /// Where to send the request.
    pub fn addr(&self) -> SocketAddr {
        self.picker.items()[self.index].addr
    }

    /// The request was answered (`failed`: with a server error), its head now.
    pub fn answered(mut self, failed: bool) {
        let rtt_us = self.began.elapsed().as_micros() as u64;
        self.report(Outcome::Answered { rtt_us, failed });
    }

    /// The request got no answer (the connection failed or broke, or it timed out).
    pub fn failed(mut self) {
        self.report(Outcome::Failed);
    }

    fn report(&mut self, outcome: Outcome) {
        self.reported = true;
        self.picker.report(self.index, outcome, now_us());
    }
}

impl Drop for Chosen {
    fn drop(&mut self) {
        if !self.reported {
            self.picker
                .report(self.index, Outcome::Unmeasured, now_us());
        }
        self.picker.items()[self.index].end();
    }
}

impl Balanced {
    /// Picks from the services `cache` resolves.
    pub fn new(cache: Arc<Cache>) -> Balanced {
        Balanced {
            cache,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Picks from services DNS resolves (`http://host:port`, literal addresses included).
    pub fn dns_only() -> Balanced {
        let dns = super::dns::Dns::system_or_literal();
        Balanced::new(Arc::new(Cache::new(Arc::new(dns))))
    }

    /// The cache it resolves through.
    pub fn cache(&self) -> &Arc<Cache> {
        &self.cache
    }

    /// An instance of `id` for one request under `policy` (`key`: the request's hash key, for
    /// consistent hashing), waiting at most `wait` for a first resolution.
    pub async fn pick(
        &self,
        id: &ServiceId,
        policy: &Policy,
        key: Option<u64>,
        wait: Duration,
    ) -> Result<Chosen, PickError> {
        let watched = self.watch(id)?;
        self.pick_from(&watched, policy, key, wait).await
    }

    /// `id`'s watched service, shared through the cache.
    pub fn watch(&self, id: &ServiceId) -> Result<Arc<Watched>, PickError> {
        self.cache.get(id).map_err(PickError::Unresolvable)
    }

    /// [`Balanced::pick`] on a service already watched.
    pub async fn pick_from(
        &self,
        watched: &Watched,
        policy: &Policy,
        key: Option<u64>,
        wait: Duration,
    ) -> Result<Chosen, PickError> {
        let id = watched.id();
        let resolved = watched.first(wait).await;
        if resolved.addrs.is_empty() {
            return Err(PickError::NoInstance(match resolved.error {
                Some(e) => format!("{id}: {e}"),
                None if resolved.generation == 0 => {
                    format!("{id}: not resolved within {} ms", wait.as_millis())
                }
                None => format!("{id}: no instance"),
            }));
        }
        let picker = self.picker(id, policy, resolved.generation, &resolved.addrs);
        let at = PickAt {
            now_us: now_us(),
            key,
        };
        let index = with_rng(|rng| picker.pick(&at, rng, |_| true))
            .ok_or_else(|| PickError::NoInstance(format!("{id}: no instance can be picked")))?;
        // No bound on requests under way: counting one always succeeds.
        picker.items()[index].try_begin(0);
        Ok(Chosen {
            picker,
            index,
            began: Stopwatch::start(),
            reported: false,
        })
    }

    /// `id`'s picker for `addrs` at `generation` under `policy`, rebuilt when either moved.
    fn picker(
        &self,
        id: &ServiceId,
        policy: &Policy,
        generation: u64,
        addrs: &[SocketAddr],
    ) -> Arc<Picker<Arc<Instance>>> {
        let mut entries = self.entries.lock().expect("balanced lock");
        if let Some(e) = entries.get(id)
            && e.generation == generation
            && e.policy == *policy
        {
            return e.picker.clone();
        }
        let old: HashMap<SocketAddr, Arc<Instance>> = entries
            .get(id)
            .map(|e| {
                e.picker
                    .items()
                    .iter()
                    .map(|i| (i.addr, i.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let now = now_us();
        let items = addrs
            .iter()
            .map(|a| {
                old.get(a)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Instance::new(*a, 1, now, policy.default_rtt_ms)))
            })
            .collect();
        let picker = Arc::new(with_rng(|rng| Picker::new(policy, items, rng)));
        if entries.len() >= super::MAX_SERVICES && !entries.contains_key(id) {
            entries.clear();
        }
        entries.insert(
            id.clone(),
            Entry {
                generation,
                policy: policy.clone(),
                picker: picker.clone(),
            },
        );
        picker
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::{Composite, Discovery, Resolved, publish};
    use tokio::sync::watch;

    /// A source whose instances the test sets: a stand-in for DNS or Kubernetes.
    struct Set(watch::Sender<Resolved>);

    impl Discovery for Set {
        fn schemes(&self) -> Vec<&'static str> {
            vec!["test"]
        }

        fn watch(&self, _: &ServiceId) -> Result<watch::Receiver<Resolved>, String> {
            Ok(self.0.subscribe())
        }
    }

    fn addr(n: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, n], 80))
    }

    #[tokio::test]
    async fn picks_follow_the_policy_the_instances_and_what_was_learnt_of_them() {
        let (tx, _) = watch::channel(Resolved::default());
        let tx = Arc::new(tx);
        let source = Composite::default().with(Arc::new(Set((*tx).clone())));
        let b = Balanced::new(Arc::new(Cache::new(Arc::new(source))));
        let id = ServiceId::parse("test://svc").unwrap();
        let rr = Policy {
            balancer: crate::discovery::Balancer::RoundRobin,
            eject_after_failures: 3,
            ..Policy::default()
        };
        let wait = Duration::from_millis(50);
        // Not resolved yet: no instance, said so.
        let e = b.pick(&id, &rr, None, wait).await.unwrap_err();
        assert!(e.to_string().contains("not resolved"), "{e}");
        let e = b
            .pick(&ServiceId::parse("nope://x").unwrap(), &rr, None, wait)
            .await
            .unwrap_err();
        assert!(matches!(e, PickError::Unresolvable(_)), "{e}");

        publish(&tx, &id, vec![addr(1), addr(2)]);
        let mut seen = HashMap::new();
        for _ in 0..100 {
            let c = b.pick(&id, &rr, None, wait).await.unwrap();
            *seen.entry(c.addr()).or_insert(0) += 1;
            c.answered(false);
        }
        assert_eq!(seen[&addr(1)], 50);
        assert_eq!(seen[&addr(2)], 50);

        // Three failures in a row eject an instance; it is passed over.
        for _ in 0..12 {
            let c = b.pick(&id, &rr, None, wait).await.unwrap();
            if c.addr() == addr(1) {
                c.failed();
            } else {
                c.answered(false);
            }
        }
        let picks = async {
            let mut v = Vec::new();
            for _ in 0..10 {
                v.push(b.pick(&id, &rr, None, wait).await.unwrap().addr());
            }
            v
        };
        assert!(picks.await.iter().all(|a| *a == addr(2)), "addr(1) ejected");

        // A new instance: the picker is rebuilt, and the ejected one stays ejected.
        publish(&tx, &id, vec![addr(1), addr(2), addr(3)]);
        let mut seen = Vec::new();
        for _ in 0..20 {
            seen.push(b.pick(&id, &rr, None, wait).await.unwrap().addr());
        }
        assert!(seen.contains(&addr(3)), "the new instance is picked");
        assert!(!seen.contains(&addr(1)), "still ejected: {seen:?}");

        // Requests under way are counted until their instance is reported or dropped.
        let c = b.pick(&id, &rr, None, wait).await.unwrap();
        let picker = c.picker.clone();
        let i = c.index;
        assert_eq!(picker.items()[i].active(), 1);
        drop(c);
        assert_eq!(picker.items()[i].active(), 0);

        // No instance left: said so.
        publish(&tx, &id, vec![]);
        let e = b.pick(&id, &rr, None, wait).await.unwrap_err();
        assert!(matches!(e, PickError::NoInstance(_)), "{e}");
    }
}
