//! The one writer: group commit, decisions against the live projection, and the live tail.
//!
//! Appends and decisions travel over a bounded channel to a dedicated thread. The thread takes the
//! first waiting request and then every other one already waiting (up to `batch_max_events`),
//! assigns seqs, folds each event into the projection, encodes them into one batch and writes it.
//! With durability `sync`, a second thread (the syncer) then syncs the log once for every batch
//! written since its previous sync, and only then acknowledges each request with the seqs it got.
//! While one sync runs, the next batch forms and is written, so a sync covers every appender that
//! was waiting, however many there are, and no appender waits for a sync that started before it.
//! A batch of submitted decisions (nobody waits for them) is always left to the syncer, so the
//! writer is free for the decision likely to follow; a batch that wrote nothing since the last
//! completed sync is acknowledged without another. When somebody waits, nothing else is queued
//! and no sync is in flight, the writer syncs inline, saving a thread hop for a lone appender.
//!
//! Snapshots are taken on the writer thread every `snapshot_every_events` and on request, always
//! after a sync, so a snapshot never covers records a crash could take away.
//!
//! A decision is a closure run on the writer thread against the projection as it is at that point
//! in the log, so two decisions never see the same state: that is what makes "start a queued call"
//! exact. Readers ([`Log::read`]) may see a batch's effects a moment before it is durable; nothing
//! is acknowledged before it is, and anything that leaves the process waits for the
//! acknowledgement. If a write fails the writer stops accepting work (fail-stop): the projection
//! may then be ahead of the disk, and only a restart, which rebuilds from the log, is safe.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;

use tokio::sync::{broadcast, mpsc, oneshot};

use ebb_core::clock::Clock;
use ebb_core::event::{Envelope, Event, SCHEMA_VERSION, encode_into};
use ebb_core::log::replay::{Projection, open_state};
use ebb_core::log::store::{LogStore, RecordBatch};
use ebb_core::log::{Durability, Error, Result};
use ebb_core::state::State;

/// Tuning of the writer. Every bound is a named value.
#[derive(Debug, Clone)]
pub struct Options {
    /// Sync each batch (the default) or leave flushing to the OS.
    pub durability: Durability,
    /// Requests that may wait for the writer; appenders wait for room beyond it.
    pub queue_max_requests: usize,
    /// Events written in one batch at most.
    pub batch_max_events: usize,
    /// Take a snapshot automatically after this many events (0: never).
    pub snapshot_every_events: u64,
    /// Batches a live-tail subscriber may fall behind before it is told it lagged.
    pub tail_max_batches: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            durability: Durability::Sync,
            queue_max_requests: 65_536,
            batch_max_events: 8_192,
            snapshot_every_events: 1_000_000,
            tail_max_batches: 1_024,
        }
    }
}

/// The seqs a request's events got: `first_seq..=last_seq` (empty when `first_seq > last_seq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    /// Seq of the first event.
    pub first_seq: u64,
    /// Seq of the last event (the log's last seq before the request when it had none).
    pub last_seq: u64,
}

impl Committed {
    /// How many events were committed.
    pub fn len(&self) -> u64 {
        (self.last_seq + 1).saturating_sub(self.first_seq)
    }

    /// No event was committed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

type Decision<P> = Box<dyn FnOnce(&P, u64) -> Vec<Event> + Send>;
type Ack = oneshot::Sender<Result<Committed>>;

enum Request<P> {
    Append {
        events: Vec<Event>,
        ack: Ack,
    },
    Decide {
        decide: Decision<P>,
        ack: Ack,
    },
    /// A decision nobody waits for: its batch is synced by the syncer or with a later one.
    Submit {
        decide: Decision<P>,
    },
    Snapshot {
        ack: oneshot::Sender<Result<u64>>,
    },
}

/// A decision for the writer, and where its answer arrives (once it ran).
#[allow(clippy::type_complexity)]
fn boxed<P, R, F>(decide: F) -> (Decision<P>, oneshot::Receiver<R>)
where
    P: Projection,
    R: Send + 'static,
    F: FnOnce(&P, u64) -> (Vec<Event>, R) + Send + 'static,
{
    let (answer_tx, answer_rx) = oneshot::channel();
    let decide: Decision<P> = Box::new(move |state, now| {
        let (events, answer) = decide(state, now);
        let _ = answer_tx.send(answer);
        events
    });
    (decide, answer_rx)
}

/// A live tail of the log: batches of envelopes as they become durable.
pub type Tail = broadcast::Receiver<Arc<[Envelope]>>;

/// The open log with its live projection.
pub struct Log<P: Projection = State> {
    tx: Option<mpsc::Sender<Request<P>>>,
    state: Arc<RwLock<P>>,
    /// The seq of the last event applied to the projection, stored after each batch is applied
    /// and before it is acknowledged.
    applied: Arc<AtomicU64>,
    store: Arc<dyn LogStore>,
    tail: broadcast::Sender<Arc<[Envelope]>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Set once by the writer when storage fails.
    failed: Failure,
    /// How long each sync to disk took.
    syncs: prometheus_client::metrics::histogram::Histogram,
    /// The longest the writer held the projection for one batch (ns) since it was last asked.
    longest_hold_ns: Arc<AtomicU64>,
}

/// A histogram of sync times, in seconds: 100 µs to about 1.6 s.
fn sync_histogram() -> prometheus_client::metrics::histogram::Histogram {
    prometheus_client::metrics::histogram::Histogram::new(
        prometheus_client::metrics::histogram::exponential_buckets(0.000_1, 2.0, 15),
    )
}

impl<P: Projection> Log<P> {
    /// How long each sync to disk took (`ebb_log_sync_duration_seconds`).
    pub fn sync_durations(&self) -> &prometheus_client::metrics::histogram::Histogram {
        &self.syncs
    }

    /// The longest the writer held the projection for one batch since this was last asked (its
    /// decisions, and the folding of their events: every other decision and every read waited
    /// meanwhile), and starts over.
    pub fn longest_hold(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.longest_hold_ns.swap(0, Ordering::AcqRel))
    }

    /// Rebuilds the projection (newest snapshot + tail), then starts the writer.
    /// `progress(seq)` is called during long replays.
    pub fn open(
        store: Arc<dyn LogStore>,
        options: Options,
        clock: Arc<dyn Clock>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Self> {
        if !store.indexed()? {
            // A log from before the subject index (or a new one): index what it holds.
            ebb_core::log::index::rebuild(store.as_ref(), progress)?;
        }
        let (state, snapshot_seq) = open_state::<P>(store.as_ref(), None, progress)?;
        let seq = state.seq();
        let last_at_ms = match seq {
            0 => 0,
            s => store
                .get(s)?
                .map(|b| ebb_core::log::decode_at(s, &b))
                .transpose()?
                .map_or(0, |e| e.at_ms),
        };
        let state = Arc::new(RwLock::new(state));
        let applied = Arc::new(AtomicU64::new(seq));
        let (tx, rx) = mpsc::channel(options.queue_max_requests.max(1));
        let (tail, _) = broadcast::channel(options.tail_max_batches.max(1));
        let failed = Failure::default();
        let syncs = sync_histogram();
        let longest_hold_ns = Arc::new(AtomicU64::new(0));
        let writer = Writer {
            syncs: syncs.clone(),
            longest_hold_ns: longest_hold_ns.clone(),
            rx,
            state: state.clone(),
            applied: applied.clone(),
            store: store.clone(),
            tail: tail.clone(),
            clock,
            seq,
            last_at_ms,
            last_snapshot_seq: snapshot_seq,
            failed: failed.clone(),
            options,
        };
        let thread = std::thread::Builder::new()
            .name("ebb-log-writer".into())
            .spawn(move || writer.run())
            .map_err(|e| Error::Storage(format!("starting the writer thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            state,
            applied,
            store,
            tail,
            thread: Mutex::new(Some(thread)),
            failed,
            syncs,
            longest_hold_ns,
        })
    }

    async fn request(&self, req: Request<P>) -> Result<()> {
        let tx = self.tx.as_ref().ok_or(Error::Closed)?;
        tx.send(req).await.map_err(|_| Error::Closed)
    }

    /// Appends one event; returns its seq once it is durable.
    pub async fn append(&self, event: Event) -> Result<u64> {
        Ok(self.append_all(vec![event]).await?.last_seq)
    }

    /// Appends events atomically and contiguously; returns their seqs once they are durable.
    pub async fn append_all(&self, events: Vec<Event>) -> Result<Committed> {
        let (ack, rx) = oneshot::channel();
        self.request(Request::Append { events, ack }).await?;
        rx.await.map_err(|_| Error::Closed)?
    }

    /// Runs `decide(state, now_ms)` on the writer against the projection as it stands at that point
    /// in the log, appends the events it returns, and once they are durable returns its answer.
    pub async fn decide<R, F>(&self, decide: F) -> Result<(R, Committed)>
    where
        R: Send + 'static,
        F: FnOnce(&P, u64) -> (Vec<Event>, R) + Send + 'static,
    {
        let (decide, answer_rx) = boxed(decide);
        let (ack, rx) = oneshot::channel();
        self.request(Request::Decide { decide, ack }).await?;
        let committed = rx.await.map_err(|_| Error::Closed)??;
        let answer = answer_rx.await.map_err(|_| Error::Closed)?;
        Ok((answer, committed))
    }

    /// Hands a decision to the writer and returns as soon as it is in line, without waiting for
    /// it to run or for its events to be durable. Anything decided after this returns runs after
    /// it and sees its events; its effects are durable once a later acknowledgement is. For what
    /// must come before a later decision in the log but needs no answer of its own. A decision
    /// that fails to write is lost, and so is every later one (the writer is fail-stop).
    pub async fn submit<F>(&self, decide: F) -> Result<()>
    where
        F: FnOnce(&P, u64) -> Vec<Event> + Send + 'static,
    {
        self.request(Request::Submit {
            decide: Box::new(decide),
        })
        .await
    }

    /// Takes a snapshot of the projection now; returns the seq it covers.
    pub async fn snapshot(&self) -> Result<u64> {
        let (ack, rx) = oneshot::channel();
        self.request(Request::Snapshot { ack }).await?;
        rx.await.map_err(|_| Error::Closed)?
    }

    /// Reads the live projection.
    pub fn read<T>(&self, f: impl FnOnce(&P) -> T) -> T {
        f(&self.state())
    }

    /// A read guard on the live projection; hold it briefly.
    pub fn state(&self) -> RwLockReadGuard<'_, P> {
        self.state.read().expect("projection lock poisoned")
    }

    /// Why the log's storage failed, once it has: the writer then takes no more events.
    pub fn failure(&self) -> Option<String> {
        self.failed.get()
    }

    /// The seq of the last event applied to the projection: a cheap way to tell that nothing
    /// changed since a value was read (no lock).
    pub fn applied_seq(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Follows new batches as they become durable.
    pub fn subscribe(&self) -> Tail {
        self.tail.subscribe()
    }

    /// Waits until `holds` is true of the projection, looking again at each durable batch, for
    /// at most `within`; whether it holds.
    pub async fn wait_until(
        &self,
        within: std::time::Duration,
        holds: impl Fn(&P) -> bool,
    ) -> bool {
        let mut tail = self.subscribe();
        let deadline = tokio::time::sleep(within);
        tokio::pin!(deadline);
        loop {
            if self.read(&holds) {
                return true;
            }
            tokio::select! {
                _ = &mut deadline => return false,
                r = tail.recv() => {
                    if matches!(r, Err(broadcast::error::RecvError::Closed)) {
                        return self.read(&holds);
                    }
                }
            }
        }
    }

    /// The store under the log.
    pub fn store(&self) -> &Arc<dyn LogStore> {
        &self.store
    }

    /// Stops the writer after it has handled every request already sent, and waits for it.
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.tx.take();
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl<P: Projection> Drop for Log<P> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Writer<P: Projection> {
    syncs: prometheus_client::metrics::histogram::Histogram,
    longest_hold_ns: Arc<AtomicU64>,
    rx: mpsc::Receiver<Request<P>>,
    state: Arc<RwLock<P>>,
    applied: Arc<AtomicU64>,
    store: Arc<dyn LogStore>,
    tail: broadcast::Sender<Arc<[Envelope]>>,
    clock: Arc<dyn Clock>,
    seq: u64,
    last_at_ms: u64,
    last_snapshot_seq: u64,
    failed: Failure,
    options: Options,
}

/// Set once by whichever thread first sees a storage failure; both threads refuse work after it.
#[derive(Clone, Default)]
struct Failure(Arc<Mutex<Option<String>>>);

impl Failure {
    fn get(&self) -> Option<String> {
        self.0.lock().expect("failure lock").clone()
    }

    fn set(&self, why: String) {
        let mut g = self.0.lock().expect("failure lock");
        if g.is_none() {
            tracing::error!(error = %why, "log storage failed; the writer stops");
            *g = Some(why);
        }
    }
}

/// Written but not yet synced: what to acknowledge and publish once a sync covers it.
struct Unsynced {
    acks: Vec<(Ack, Committed)>,
    tail: Vec<Envelope>,
    /// The log's last seq once this was written.
    up_to: u64,
}

/// Batches written and waiting for the syncer at most; beyond it the writer waits.
const SYNC_QUEUE_MAX_BATCHES: usize = 4;

impl<P: Projection> Request<P> {
    fn events_hint(&self) -> usize {
        match self {
            Request::Append { events, .. } => events.len(),
            _ => 1,
        }
    }

    fn fail(self, err: impl Fn() -> Error) {
        match self {
            Request::Append { ack, .. } | Request::Decide { ack, .. } => {
                let _ = ack.send(Err(err()));
            }
            Request::Submit { .. } => {}
            Request::Snapshot { ack } => {
                let _ = ack.send(Err(err()));
            }
        }
    }
}

/// Acknowledges a durable group and publishes it to the live tail, in log order.
fn publish(group: Vec<Unsynced>, tail: &broadcast::Sender<Arc<[Envelope]>>) {
    for u in group {
        for (ack, c) in u.acks {
            let _ = ack.send(Ok(c));
        }
        if !u.tail.is_empty() {
            let _ = tail.send(Arc::from(u.tail));
        }
    }
}

/// The syncer: while it syncs one group of written batches, the writer writes the next, so each
/// sync covers everything written since the previous one started.
fn run_syncer(
    rx: std::sync::mpsc::Receiver<Unsynced>,
    store: Arc<dyn LogStore>,
    tail: broadcast::Sender<Arc<[Envelope]>>,
    failed: Failure,
    in_flight: Arc<AtomicUsize>,
    synced_seq: Arc<AtomicU64>,
    syncs: prometheus_client::metrics::histogram::Histogram,
) {
    while let Ok(first) = rx.recv() {
        let mut group = vec![first];
        group.extend(rx.try_iter());
        let n = group.len();
        let up_to = group.iter().map(|u| u.up_to).max().unwrap_or(0);
        let synced = match failed.get() {
            Some(why) => Err(why),
            // An earlier sync covered it all (a group that wrote nothing new).
            None if synced_seq.load(Ordering::Acquire) >= up_to => Ok(()),
            None => {
                let watch = ebb_core::clock::Stopwatch::start();
                let r = store.sync().map_err(|e| e.to_string());
                syncs.observe(watch.elapsed().as_secs_f64());
                r
            }
        };
        match synced {
            Ok(()) => {
                synced_seq.fetch_max(up_to, Ordering::AcqRel);
                publish(group, &tail)
            }
            Err(why) => {
                failed.set(why.clone());
                for u in group {
                    for (ack, _) in u.acks {
                        let _ = ack.send(Err(Error::Failed(why.clone())));
                    }
                }
            }
        }
        in_flight.fetch_sub(n, Ordering::AcqRel);
    }
}

impl<P: Projection> Writer<P> {
    fn run(mut self) {
        let syncing = self.options.durability == Durability::Sync;
        let (sync_tx, sync_rx) = std::sync::mpsc::sync_channel(SYNC_QUEUE_MAX_BATCHES);
        // Groups handed to the syncer and not yet acknowledged.
        let in_flight = Arc::new(AtomicUsize::new(0));
        // The last seq a completed sync covers (0 until the first: what the log held at open
        // counts as unsynced).
        let synced_seq = Arc::new(AtomicU64::new(0));
        let syncer = syncing.then(|| {
            let (store, tail, failed) =
                (self.store.clone(), self.tail.clone(), self.failed.clone());
            let (in_flight, synced_seq) = (in_flight.clone(), synced_seq.clone());
            let syncs = self.syncs.clone();
            std::thread::Builder::new()
                .name("ebb-log-syncer".into())
                .spawn(move || {
                    run_syncer(sync_rx, store, tail, failed, in_flight, synced_seq, syncs)
                })
                .expect("starting the log syncer thread")
        });
        let mut batch = RecordBatch::default();
        let mut snapshot_acks = Vec::new();
        let mut requests = Vec::new();
        while let Some(first) = self.rx.blocking_recv() {
            let mut n = first.events_hint();
            requests.push(first);
            while n < self.options.batch_max_events {
                match self.rx.try_recv() {
                    Ok(r) => {
                        n += r.events_hint();
                        requests.push(r);
                    }
                    Err(_) => break,
                }
            }
            if let Some(why) = self.failed.get() {
                for r in requests.drain(..) {
                    r.fail(|| Error::Failed(why.clone()));
                }
                continue;
            }
            let at_ms = self.last_at_ms.max(self.clock.now_ms());
            self.last_at_ms = at_ms;
            let want_tail = self.tail.receiver_count() > 0;
            let mut unsynced = Unsynced {
                acks: Vec::with_capacity(requests.len()),
                tail: Vec::new(),
                up_to: 0,
            };
            {
                let mut state = self.state.write().expect("projection lock poisoned");
                let held = ebb_core::clock::Stopwatch::start();
                for r in requests.drain(..) {
                    let (events, ack) = match r {
                        Request::Append { events, ack } => (events, Some(ack)),
                        Request::Decide { decide, ack } => (decide(&state, at_ms), Some(ack)),
                        Request::Submit { decide } => (decide(&state, at_ms), None),
                        Request::Snapshot { ack } => {
                            snapshot_acks.push(ack);
                            continue;
                        }
                    };
                    let first_seq = self.seq + 1;
                    for event in events {
                        self.seq += 1;
                        let env = Envelope {
                            seq: self.seq,
                            at_ms,
                            version: SCHEMA_VERSION,
                            event,
                        };
                        batch.push_with(env.seq, |buf| {
                            encode_into(buf, env.seq, env.at_ms, &env.event)
                        });
                        ebb_core::log::index::add(&mut batch, &env);
                        state.apply(&env);
                        if want_tail {
                            unsynced.tail.push(env);
                        }
                    }
                    if let Some(ack) = ack {
                        unsynced.acks.push((
                            ack,
                            Committed {
                                first_seq,
                                last_seq: self.seq,
                            },
                        ));
                    }
                }
                let held = u64::try_from(held.elapsed().as_nanos()).unwrap_or(u64::MAX);
                self.longest_hold_ns.fetch_max(held, Ordering::AcqRel);
            }
            unsynced.up_to = self.seq;
            self.applied.store(self.seq, Ordering::Release);
            // Written without a sync: the syncer makes it durable while the next batch forms.
            let written_nothing = batch.is_empty();
            let written = if batch.is_empty() {
                Ok(())
            } else {
                self.store.write(&batch, false)
            };
            batch.clear();
            if let Err(e) = written {
                let why = e.to_string();
                self.failed.set(why.clone());
                for (ack, _) in unsynced.acks {
                    let _ = ack.send(Err(Error::Failed(why.clone())));
                }
                continue;
            }
            let idle_syncer = in_flight.load(Ordering::Acquire) == 0;
            if !syncing {
                publish(vec![unsynced], &self.tail);
            } else if unsynced.acks.is_empty() && written_nothing {
                // Submitted decisions that decided nothing: nothing to make durable or publish.
            } else if idle_syncer && synced_seq.load(Ordering::Acquire) >= self.seq {
                // Nothing written since the last sync, which every earlier group's
                // acknowledgement has already waited for: acknowledge at once, in log order.
                publish(vec![unsynced], &self.tail);
            } else if idle_syncer && self.rx.is_empty() && !unsynced.acks.is_empty() {
                // Somebody waits and there is nothing to overlap the sync with: sync here and
                // save a thread hop. Every earlier group is acknowledged already, so
                // acknowledgements stay in log order. (A batch nobody waits for goes to the
                // syncer instead, so the writer is free for the decision likely to follow.)
                let watch = ebb_core::clock::Stopwatch::start();
                let synced = self.store.sync();
                self.syncs.observe(watch.elapsed().as_secs_f64());
                match synced {
                    Ok(()) => {
                        synced_seq.fetch_max(self.seq, Ordering::AcqRel);
                        publish(vec![unsynced], &self.tail)
                    }
                    Err(e) => {
                        let why = e.to_string();
                        self.failed.set(why.clone());
                        for (ack, _) in unsynced.acks {
                            let _ = ack.send(Err(Error::Failed(why.clone())));
                        }
                    }
                }
            } else {
                in_flight.fetch_add(1, Ordering::AcqRel);
                // Blocks when the syncer is SYNC_QUEUE_MAX_BATCHES behind: backpressure.
                if let Err(unsent) = sync_tx.send(unsynced) {
                    for (ack, _) in unsent.0.acks {
                        let _ = ack.send(Err(Error::Closed));
                    }
                }
            }
            let every = self.options.snapshot_every_events;
            let due = every > 0 && self.seq - self.last_snapshot_seq >= every;
            if due || !snapshot_acks.is_empty() {
                let taken = self.take_snapshot();
                if let Err(e) = &taken {
                    tracing::warn!(error = %e, "snapshot failed");
                }
                for ack in snapshot_acks.drain(..) {
                    let _ = ack.send(match &taken {
                        Ok(seq) => Ok(*seq),
                        Err(e) => Err(Error::Storage(e.to_string())),
                    });
                }
            }
        }
        drop(sync_tx);
        if let Some(s) = syncer {
            let _ = s.join();
        }
    }

    fn take_snapshot(&mut self) -> Result<u64> {
        // A snapshot must never cover records that a crash could take away.
        self.store.sync()?;
        let bytes = {
            let state = self.state.read().expect("projection lock poisoned");
            debug_assert_eq!(state.seq(), self.seq);
            state.encode_snapshot()
        };
        self.store.put_snapshot(self.seq, &bytes)?;
        self.last_snapshot_seq = self.seq;
        tracing::debug!(seq = self.seq, bytes = bytes.len(), "snapshot taken");
        Ok(self.seq)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use ebb_core::clock::SimClock;
    use ebb_core::event::CallSpec;
    use ebb_core::log::MemStore;
    use ebb_core::state::StartVerdict;
    use ebb_core::state::calls::decide_start;

    fn seen(route: &str, n: u64) -> Event {
        Event::RequestsSeen {
            route: route.into(),
            count: n,
            last_at_ms: n,
        }
    }

    fn open(store: Arc<dyn LogStore>, clock: &SimClock) -> Log {
        Log::open(
            store,
            Options::default(),
            Arc::new(clock.clone()),
            &mut |_| {},
        )
        .unwrap()
    }

    fn seqs_of(store: &dyn LogStore, route: &str) -> Vec<u64> {
        let subject = ebb_core::log::index::of(ebb_core::event::Kind::Route, route);
        ebb_core::log::index::seqs(store, &[subject], 0).unwrap()
    }

    #[tokio::test]
    async fn appends_are_indexed_with_their_batch_and_an_older_log_is_indexed_at_open() {
        let clock = SimClock::new(5_000);
        // A log written before the index: records only.
        let store = Arc::new(MemStore::new());
        let mut old = RecordBatch::default();
        for seq in 1..=3u64 {
            old.push_with(seq, |buf| encode_into(buf, seq, 1_000, &seen("a", seq)));
        }
        store.write(&old, true).unwrap();
        assert!(!store.indexed().unwrap());
        assert!(seqs_of(store.as_ref(), "a").is_empty());
        let log = open(store.clone(), &clock);
        assert!(store.indexed().unwrap());
        assert_eq!(seqs_of(store.as_ref(), "a"), vec![1, 2, 3]);
        log.append_all(vec![seen("b", 4), seen("a", 5)])
            .await
            .unwrap();
        log.close();
        assert_eq!(seqs_of(store.as_ref(), "a"), vec![1, 2, 3, 5]);
        assert_eq!(seqs_of(store.as_ref(), "b"), vec![4]);
    }

    #[tokio::test]
    async fn appends_get_contiguous_seqs_and_time_never_goes_back() {
        let clock = SimClock::new(5_000);
        let store = Arc::new(MemStore::new());
        let log = open(store.clone(), &clock);
        assert_eq!(log.append(seen("a", 1)).await.unwrap(), 1);
        let c = log
            .append_all(vec![seen("a", 2), seen("b", 3), seen("c", 4)])
            .await
            .unwrap();
        assert_eq!((c.first_seq, c.last_seq, c.len()), (2, 4, 3));
        let empty = log.append_all(vec![]).await.unwrap();
        assert!(empty.is_empty());
        clock.set(1_000); // The clock jumps back: envelope times must not.
        log.append(seen("a", 5)).await.unwrap();
        log.close();
        let mut times = Vec::new();
        store
            .scan(1, u64::MAX, &mut |seq, b| {
                times.push(ebb_core::log::decode_at(seq, b).unwrap().at_ms);
                true
            })
            .unwrap();
        assert_eq!(times, vec![5_000; 5]);
        // Reopening continues the seqs and keeps the time from going back.
        let log = open(store.clone(), &clock);
        assert_eq!(log.append(seen("a", 6)).await.unwrap(), 6);
        let last = ebb_core::log::decode_at(6, &store.get(6).unwrap().unwrap()).unwrap();
        assert_eq!(last.at_ms, 5_000);
    }

    #[tokio::test]
    async fn the_longest_hold_is_of_the_batches_since_it_was_last_asked() {
        let clock = SimClock::new(0);
        let log = open(Arc::new(MemStore::new()), &clock);
        log.append(seen("a", 1)).await.unwrap();
        assert!(log.longest_hold() > std::time::Duration::ZERO);
        // No batch since: nothing held.
        assert_eq!(log.longest_hold(), std::time::Duration::ZERO);
        log.close();
    }

    #[tokio::test]
    async fn the_live_tail_sees_every_durable_batch_in_order() {
        let clock = SimClock::new(0);
        let log = open(Arc::new(MemStore::new()), &clock);
        let mut tail = log.subscribe();
        for i in 0..10 {
            log.append(seen("a", i)).await.unwrap();
        }
        let mut seqs = Vec::new();
        while seqs.len() < 10 {
            let batch = tail.recv().await.unwrap();
            seqs.extend(batch.iter().map(|e| e.seq));
        }
        assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_submitted_decision_runs_before_any_decided_after_it() {
        let clock = SimClock::new(0);
        let store = Arc::new(MemStore::new());
        let log = open(store.clone(), &clock);
        let call = CallSpec::for_test("c");
        // Submitted, not awaited: the start decided next still finds the call queued, and its
        // acknowledgement covers both.
        log.submit(move |_: &State, _| {
            vec![Event::CallQueued {
                call: std::sync::Arc::new(call),
            }]
        })
        .await
        .unwrap();
        let (verdict, committed) = log
            .decide(|s: &State, now| {
                let (ev, v) = decide_start(&s.calls, "c", "r", now);
                (vec![ev], v)
            })
            .await
            .unwrap();
        assert_eq!(verdict, StartVerdict::Accepted);
        assert_eq!((committed.first_seq, committed.last_seq), (2, 2));
        log.close();
        assert_eq!(store.last_seq().unwrap(), 2);
    }

    #[tokio::test]
    async fn only_what_is_written_since_the_last_sync_costs_a_sync() {
        let clock = SimClock::new(0);
        let store = Arc::new(MemStore::new());
        let log = open(store.clone(), &clock);
        log.append(seen("a", 1)).await.unwrap();
        let after_first = store.syncs();
        assert!(after_first >= 1);
        // A decision that writes nothing, after everything was synced: acknowledged at once.
        log.decide(|_: &State, _| (Vec::new(), ())).await.unwrap();
        assert_eq!(store.syncs(), after_first);
        // After a submitted decision, one that writes nothing still waits for that one's sync.
        log.submit(|_: &State, _| vec![seen("a", 2)]).await.unwrap();
        log.decide(|_: &State, _| (Vec::new(), ())).await.unwrap();
        store.crash();
        assert_eq!(
            store.last_seq().unwrap(),
            2,
            "the submitted event was durable"
        );
    }

    #[tokio::test]
    async fn a_submitted_decision_reaches_the_live_tail_with_nothing_after_it() {
        let clock = SimClock::new(0);
        let log = open(Arc::new(MemStore::new()), &clock);
        let mut tail = log.subscribe();
        log.submit(|_: &State, _| vec![seen("a", 1)]).await.unwrap();
        let batch = tokio::time::timeout(std::time::Duration::from_secs(10), tail.recv())
            .await
            .expect("published within the deadline")
            .unwrap();
        assert_eq!(batch.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_starts_of_one_call_accept_exactly_one() {
        let clock = SimClock::new(0);
        let log = Arc::new(open(Arc::new(MemStore::new()), &clock));
        log.append(Event::CallQueued {
            call: std::sync::Arc::new(CallSpec::for_test("c")),
        })
        .await
        .unwrap();
        let mut tasks = Vec::new();
        for r in 0..64 {
            let log = log.clone();
            tasks.push(tokio::spawn(async move {
                let runner = format!("runner-{r}");
                let (verdict, _) = log
                    .decide(move |s: &State, now| {
                        let (ev, v) = decide_start(&s.calls, "c", &runner, now);
                        (vec![ev], v)
                    })
                    .await
                    .unwrap();
                verdict
            }));
        }
        let mut accepted = 0;
        for t in tasks {
            if t.await.unwrap() == StartVerdict::Accepted {
                accepted += 1;
            }
        }
        assert_eq!(accepted, 1);
        let call = log.read(|s| s.calls.get("c").cloned().unwrap());
        assert_eq!(call.starts, 1);
        assert_eq!(call.refused_starts, 63);
        // The second start found it running: it must not run again, so it is now an error.
        assert_eq!(call.status, ebb_core::state::CallStatus::Error);
    }

    /// A store whose writes fail once told to.
    struct Failing {
        inner: MemStore,
        fail: AtomicBool,
        fail_sync: AtomicBool,
    }

    impl LogStore for Failing {
        fn write(&self, batch: &RecordBatch, sync: bool) -> Result<()> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(Error::Storage("disk on fire".into()));
            }
            self.inner.write(batch, sync)
        }
        fn sync(&self) -> Result<()> {
            if self.fail_sync.load(Ordering::SeqCst) {
                return Err(Error::Storage("fsync: input/output error".into()));
            }
            self.inner.sync()
        }
        fn last_seq(&self) -> Result<u64> {
            self.inner.last_seq()
        }
        fn first_seq(&self) -> Result<Option<u64>> {
            self.inner.first_seq()
        }
        fn get(&self, seq: u64) -> Result<Option<Vec<u8>>> {
            self.inner.get(seq)
        }
        fn scan(&self, from: u64, to: u64, v: &mut dyn FnMut(u64, &[u8]) -> bool) -> Result<()> {
            self.inner.scan(from, to, v)
        }
        fn put_snapshot(&self, seq: u64, bytes: &[u8]) -> Result<()> {
            self.inner.put_snapshot(seq, bytes)
        }
        fn snapshot_seqs(&self) -> Result<Vec<u64>> {
            self.inner.snapshot_seqs()
        }
        fn get_snapshot(&self, seq: u64) -> Result<Option<Vec<u8>>> {
            self.inner.get_snapshot(seq)
        }
        fn subject_seqs(&self, s: &[u8], from: u64, v: &mut dyn FnMut(u64) -> bool) -> Result<()> {
            self.inner.subject_seqs(s, from, v)
        }
        fn indexed(&self) -> Result<bool> {
            self.inner.indexed()
        }
        fn mark_indexed(&self) -> Result<()> {
            self.inner.mark_indexed()
        }
        fn clear_index(&self) -> Result<()> {
            self.inner.clear_index()
        }
        fn delete_before(&self, before: u64) -> Result<u64> {
            self.inner.delete_before(before)
        }
    }

    #[tokio::test]
    async fn a_failed_write_stops_the_writer_for_good() {
        let store = Arc::new(Failing {
            inner: MemStore::new(),
            fail: AtomicBool::new(false),
            fail_sync: AtomicBool::new(false),
        });
        let log = open(store.clone(), &SimClock::new(0));
        log.append(seen("a", 1)).await.unwrap();
        store.fail.store(true, Ordering::SeqCst);
        let err = log.append(seen("a", 2)).await.unwrap_err();
        assert!(
            matches!(err, Error::Failed(ref why) if why.contains("disk on fire")),
            "{err}"
        );
        store.fail.store(false, Ordering::SeqCst);
        // Even with the disk back, the writer refuses: its state may be ahead of the disk.
        assert!(matches!(
            log.append(seen("a", 3)).await,
            Err(Error::Failed(_))
        ));
        assert!(matches!(log.snapshot().await, Err(Error::Failed(_))));
        assert_eq!(store.last_seq().unwrap(), 1);
        log.close();
        // A restart rebuilds from what is on disk.
        let log = open(store.clone(), &SimClock::new(0));
        assert_eq!(log.read(|s| s.seq), 1);
        assert_eq!(log.append(seen("a", 4)).await.unwrap(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_sync_fails_every_waiting_appender_and_stops_the_writer() {
        let store = Arc::new(Failing {
            inner: MemStore::new(),
            fail: AtomicBool::new(false),
            fail_sync: AtomicBool::new(false),
        });
        let log = Arc::new(open(store.clone(), &SimClock::new(0)));
        // Concurrent appenders go through the syncer thread as well as the inline sync.
        let appends = |n: u64| {
            let log = log.clone();
            async move {
                let tasks: Vec<_> = (0..n)
                    .map(|i| {
                        let log = log.clone();
                        tokio::spawn(async move { log.append(seen("a", i)).await })
                    })
                    .collect();
                let mut results = Vec::new();
                for t in tasks {
                    results.push(t.await.unwrap());
                }
                results
            }
        };
        assert!(appends(200).await.iter().all(|r| r.is_ok()));
        store.fail_sync.store(true, Ordering::SeqCst);
        let failed = appends(200).await;
        assert!(
            failed
                .iter()
                .all(|r| matches!(r, Err(Error::Failed(why)) if why.contains("fsync"))),
            "{failed:?}"
        );
        store.fail_sync.store(false, Ordering::SeqCst);
        assert!(matches!(
            log.append(seen("a", 0)).await,
            Err(Error::Failed(_))
        ));
    }
}
