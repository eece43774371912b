//! The embedded queue: messages in a RocksDB database of their own (`<data-dir>/queue`), with an
//! index in memory.
//!
//! * `m` + seq (big-endian) -> the message (id, partition, body), written before [`Queue::put`]
//!   returns; synced there only with `sync_puts`. Unsynced, a put survives a crash of ebb (the
//!   write-ahead log is in the kernel's hands) but not necessarily one of the machine: the call
//!   service records every call in its own synced log and puts back, at start-up, the queued
//!   calls [`Queue::missing`] names. One fsync per enqueue instead of two.
//! * `r` + seq -> its delivery state (reserved by a runner until a time, or held for a started
//!   call until its deadline) and delivery count. These writes are not synced: they survive a
//!   crash of ebb (the write-ahead log is in the kernel's hands), and a lost one after a machine
//!   crash only means an earlier redelivery, which the start rule makes harmless.
//!
//! The index keeps ids, partitions and states, not bodies (read back on delivery), so memory is
//! bounded by `max_messages` small entries. Order within a partition is the order of `put`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rocksdb::{DB, Options as DbOptions, WriteBatch, WriteOptions};
use serde::{Deserialize, Serialize};

use ebb_core::clock::Clock;
use ebb_core::queue::{Message, Queue, QueueError, QueueFuture, QueueStats};

/// Tuning of the embedded queue.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// How long a runner may keep a message it did not start before it is redelivered.
    pub visibility_timeout_ms: u64,
    /// The most messages the queue holds; a put beyond it fails.
    pub max_messages: usize,
    /// Sync every put to disk before it returns. Off by default: the call service's log is the
    /// durable record and puts back what a machine crash lost (see the module docs).
    pub sync_puts: bool,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        Self {
            visibility_timeout_ms: 30_000,
            max_messages: 1_000_000,
            sync_puts: false,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    id: String,
    partition: String,
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Delivery {
    /// Handed to `runner`, back on the queue at `until_ms` unless held or deleted.
    Reserved { runner: String, until_ms: u64 },
    /// A started call's message, kept until `until_ms`.
    Held { until_ms: u64 },
}

#[derive(Debug, Serialize, Deserialize)]
struct DeliveryRecord {
    delivery: Delivery,
    deliveries: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SlotState {
    /// Being written by a put.
    Pending,
    Ready,
    Out(Delivery),
}

#[derive(Debug)]
struct Slot {
    partition: String,
    seq: u64,
    deliveries: u32,
    state: SlotState,
}

#[derive(Debug, Default)]
struct Index {
    next_seq: u64,
    slots: HashMap<String, Slot>,
    /// Ready messages per partition, by seq.
    ready: HashMap<String, BTreeMap<u64, String>>,
    /// When delivered messages come back: (until_ms, seq, id).
    timers: BTreeSet<(u64, u64, String)>,
    /// Messages handed out (reserved or held).
    out: usize,
}

impl Index {
    fn make_ready(&mut self, id: &str) {
        let Some(slot) = self.slots.get_mut(id) else {
            return;
        };
        if let SlotState::Out(d) = &slot.state {
            let until = match d {
                Delivery::Reserved { until_ms, .. } | Delivery::Held { until_ms } => *until_ms,
            };
            self.timers.remove(&(until, slot.seq, id.to_owned()));
            self.out -= 1;
        }
        slot.state = SlotState::Ready;
        self.ready
            .entry(slot.partition.clone())
            .or_default()
            .insert(slot.seq, id.to_owned());
    }

    /// Takes a message out of the ready sets or the timers, wherever it is.
    fn unlist(&mut self, id: &str) {
        let Some(slot) = self.slots.get(id) else {
            return;
        };
        match &slot.state {
            SlotState::Ready => {
                if let Some(p) = self.ready.get_mut(&slot.partition) {
                    p.remove(&slot.seq);
                    if p.is_empty() {
                        self.ready.remove(&slot.partition);
                    }
                }
            }
            SlotState::Out(d) => {
                let until = match d {
                    Delivery::Reserved { until_ms, .. } | Delivery::Held { until_ms } => *until_ms,
                };
                self.timers.remove(&(until, slot.seq, id.to_owned()));
                self.out -= 1;
            }
            SlotState::Pending => {}
        }
    }

    /// Puts delivered messages whose time is up back on the queue.
    fn expire(&mut self, now_ms: u64) {
        while let Some((until, _, id)) = self.timers.first().cloned() {
            if until > now_ms {
                break;
            }
            self.make_ready(&id);
        }
    }

    fn next_timer(&self) -> Option<u64> {
        self.timers.first().map(|t| t.0)
    }

    fn set_out(&mut self, id: &str, delivery: Delivery) {
        self.unlist(id);
        let Some(slot) = self.slots.get_mut(id) else {
            return;
        };
        let until = match &delivery {
            Delivery::Reserved { until_ms, .. } | Delivery::Held { until_ms } => *until_ms,
        };
        self.timers.insert((until, slot.seq, id.to_owned()));
        slot.state = SlotState::Out(delivery);
        self.out += 1;
    }
}

/// The embedded queue.
pub struct EmbeddedQueue {
    db: Arc<DB>,
    clock: Arc<dyn Clock>,
    options: EmbeddedOptions,
    index: Arc<Mutex<Index>>,
    arrived: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for EmbeddedQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedQueue")
            .field("stats", &self.stats())
            .finish()
    }
}

fn key(prefix: u8, seq: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = prefix;
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn storage(e: impl std::fmt::Display) -> QueueError {
    QueueError::Storage(e.to_string())
}

fn unsynced() -> WriteOptions {
    let mut w = WriteOptions::default();
    w.set_sync(false);
    w
}

impl EmbeddedQueue {
    /// Opens (or creates) the queue in `path` and rebuilds its index.
    pub fn open(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
        options: EmbeddedOptions,
    ) -> Result<Self, QueueError> {
        let mut o = DbOptions::default();
        o.create_if_missing(true);
        o.increase_parallelism(2);
        o.set_keep_log_file_num(4);
        o.set_max_total_wal_size(128 << 20);
        let db = DB::open(&o, path.as_ref()).map_err(storage)?;
        let mut index = Index::default();
        for item in db.prefix_iterator(b"m") {
            let (k, v) = item.map_err(storage)?;
            if k.first() != Some(&b'm') {
                break;
            }
            let seq = seq_of(&k)?;
            let stored: Stored = rmp_serde::from_slice(&v).map_err(storage)?;
            index.next_seq = index.next_seq.max(seq + 1);
            index.slots.insert(
                stored.id.clone(),
                Slot {
                    partition: stored.partition,
                    seq,
                    deliveries: 0,
                    state: SlotState::Pending,
                },
            );
        }
        let by_seq: HashMap<u64, String> = index
            .slots
            .iter()
            .map(|(id, s)| (s.seq, id.clone()))
            .collect();
        let mut stale = WriteBatch::default();
        for item in db.prefix_iterator(b"r") {
            let (k, v) = item.map_err(storage)?;
            if k.first() != Some(&b'r') {
                break;
            }
            let seq = seq_of(&k)?;
            let Some(id) = by_seq.get(&seq) else {
                stale.delete(&k);
                continue;
            };
            let record: DeliveryRecord = rmp_serde::from_slice(&v).map_err(storage)?;
            if let Some(slot) = index.slots.get_mut(id) {
                slot.deliveries = record.deliveries;
            }
            index.set_out(id, record.delivery);
        }
        db.write_opt(stale, &unsynced()).map_err(storage)?;
        let pending: Vec<String> = index
            .slots
            .iter()
            .filter(|(_, s)| s.state == SlotState::Pending)
            .map(|(id, _)| id.clone())
            .collect();
        for id in pending {
            index.make_ready(&id);
        }
        index.expire(clock.now_ms());
        Ok(Self {
            db: Arc::new(db),
            clock,
            options,
            index: Arc::new(Mutex::new(index)),
            arrived: Arc::new(tokio::sync::Notify::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().expect("queue index lock")
    }

    fn take(&self, runner: &str, max: usize) -> Vec<(u64, String, String, u32, u64)> {
        let now = self.clock.now_ms();
        let until_ms = now + self.options.visibility_timeout_ms;
        let mut index = self.lock();
        index.expire(now);
        let mut taken = Vec::new();
        for partition in [runner, ""] {
            while taken.len() < max {
                let Some(p) = index.ready.get_mut(partition) else {
                    break;
                };
                let Some((_, id)) = p.pop_first() else {
                    break;
                };
                if p.is_empty() {
                    index.ready.remove(partition);
                }
                let slot = index.slots.get_mut(&id).expect("ready ids have slots");
                slot.deliveries += 1;
                // Popped from ready already: mark it ready-less, then out.
                slot.state = SlotState::Pending;
                let (seq, partition, deliveries) =
                    (slot.seq, slot.partition.clone(), slot.deliveries);
                index.set_out(
                    &id,
                    Delivery::Reserved {
                        runner: runner.to_owned(),
                        until_ms,
                    },
                );
                taken.push((seq, id, partition, deliveries, until_ms));
            }
            if partition.is_empty() {
                break;
            }
        }
        // Recorded under the lock, so a hold that follows is never overwritten on disk.
        let mut batch = WriteBatch::default();
        for (seq, _, _, deliveries, until_ms) in &taken {
            let record = DeliveryRecord {
                delivery: Delivery::Reserved {
                    runner: runner.to_owned(),
                    until_ms: *until_ms,
                },
                deliveries: *deliveries,
            };
            if let Ok(bytes) = rmp_serde::to_vec(&record) {
                batch.put(key(b'r', *seq), bytes);
            }
        }
        if let Err(e) = self.db.write_opt(batch, &unsynced()) {
            // Not recorded: after a restart these come back sooner, which is safe.
            tracing::warn!(error = %e, "recording deliveries failed");
        }
        taken
    }

    /// Reads the bodies of taken messages.
    fn deliver(
        &self,
        taken: Vec<(u64, String, String, u32, u64)>,
    ) -> Result<Vec<Message>, QueueError> {
        let keys: Vec<[u8; 9]> = taken.iter().map(|t| key(b'm', t.0)).collect();
        let bodies = self.db.multi_get(&keys);
        let mut out = Vec::with_capacity(taken.len());
        for ((_, id, partition, deliveries, _), body) in taken.into_iter().zip(bodies) {
            let Some(bytes) = body.map_err(storage)? else {
                continue; // deleted meanwhile
            };
            let stored: Stored = rmp_serde::from_slice(&bytes).map_err(storage)?;
            out.push(Message {
                id,
                partition,
                body: stored.body,
                deliveries,
                put_at_ms: None,
            });
        }
        Ok(out)
    }
}

fn seq_of(key: &[u8]) -> Result<u64, QueueError> {
    let bytes: [u8; 8] = key
        .get(1..9)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| QueueError::Storage(format!("bad queue key of {} bytes", key.len())))?;
    Ok(u64::from_be_bytes(bytes))
}

impl Queue for EmbeddedQueue {
    fn put(&self, messages: Vec<Message>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut batch = WriteBatch::default();
            let mut ids = Vec::with_capacity(messages.len());
            {
                let mut index = self.lock();
                if index.slots.len() + messages.len() > self.options.max_messages {
                    return Err(QueueError::Full(self.options.max_messages));
                }
                let mut seen = std::collections::HashSet::new();
                for m in &messages {
                    if index.slots.contains_key(&m.id) || !seen.insert(m.id.as_str()) {
                        return Err(QueueError::Duplicate(m.id.clone()));
                    }
                }
                let mut encoded = Vec::with_capacity(messages.len());
                for m in messages {
                    let stored = Stored {
                        id: m.id.clone(),
                        partition: m.partition.clone(),
                        body: m.body,
                    };
                    encoded.push((
                        m.id,
                        m.partition,
                        rmp_serde::to_vec(&stored).map_err(storage)?,
                    ));
                }
                for (id, partition, bytes) in encoded {
                    let m = Message::new(id, partition, Vec::new());
                    let seq = index.next_seq;
                    index.next_seq += 1;
                    batch.put(key(b'm', seq), bytes);
                    index.slots.insert(
                        m.id.clone(),
                        Slot {
                            partition: m.partition,
                            seq,
                            deliveries: 0,
                            state: SlotState::Pending,
                        },
                    );
                    ids.push(m.id);
                }
            }
            let db = self.db.clone();
            let synced = self.options.sync_puts;
            let index = self.index.clone();
            let arrived = self.arrived.clone();
            let write = move || {
                let mut sync = WriteOptions::default();
                sync.set_sync(synced);
                let written = db.write_opt(batch, &sync).map_err(storage);
                let mut index = index.lock().expect("queue index lock");
                for id in &ids {
                    if written.is_ok() {
                        index.make_ready(id);
                    } else {
                        index.slots.remove(id);
                    }
                }
                drop(index);
                if written.is_ok() {
                    arrived.notify_waiters();
                }
                written
            };
            // An unsynced write only hands bytes to the kernel, like every other write of this
            // queue: it runs right here. A synced one waits for the disk, so on a multi-threaded
            // runtime it runs here while the runtime moves this worker's other tasks away;
            // elsewhere on the blocking pool. It runs to the end either way, so no message is
            // left pending if the caller goes away.
            if !synced {
                return write();
            }
            match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                    tokio::task::block_in_place(write)
                }
                _ => tokio::task::spawn_blocking(write).await.map_err(storage)?,
            }
        })
    }

    fn reserve(&self, runner: &str, max: usize, wait: Duration) -> QueueFuture<'_, Vec<Message>> {
        let runner = runner.to_owned();
        Box::pin(async move {
            let deadline = tokio::time::sleep(wait);
            tokio::pin!(deadline);
            loop {
                let arrived = self.arrived.notified();
                tokio::pin!(arrived);
                arrived.as_mut().enable();
                let taken = self.take(&runner, max.max(1));
                if !taken.is_empty() {
                    let got = self.deliver(taken)?;
                    if !got.is_empty() {
                        return Ok(got);
                    }
                    continue;
                }
                // Wake for a put, a delivered message coming back, or the end of the wait.
                let next = self.lock().next_timer();
                let back = async {
                    match next {
                        Some(at) => {
                            let ms = at.saturating_sub(self.clock.now_ms()).max(1);
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                        }
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = &mut arrived => {}
                    () = back => {}
                    () = &mut deadline => return Ok(Vec::new()),
                }
            }
        })
    }

    fn hold(&self, holds: Vec<(String, u64)>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut batch = WriteBatch::default();
            {
                let mut index = self.lock();
                for (id, until_ms) in holds {
                    let Some(slot) = index.slots.get(&id) else {
                        continue;
                    };
                    if slot.state == SlotState::Pending {
                        continue;
                    }
                    let (seq, deliveries) = (slot.seq, slot.deliveries);
                    index.set_out(&id, Delivery::Held { until_ms });
                    let record = DeliveryRecord {
                        delivery: Delivery::Held { until_ms },
                        deliveries,
                    };
                    batch.put(key(b'r', seq), rmp_serde::to_vec(&record).map_err(storage)?);
                }
            }
            self.db.write_opt(batch, &unsynced()).map_err(storage)
        })
    }

    fn delete(&self, ids: Vec<String>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut batch = WriteBatch::default();
            {
                let mut index = self.lock();
                for id in &ids {
                    index.unlist(id);
                    if let Some(slot) = index.slots.remove(id) {
                        batch.delete(key(b'm', slot.seq));
                        batch.delete(key(b'r', slot.seq));
                    }
                }
            }
            self.db.write_opt(batch, &unsynced()).map_err(storage)
        })
    }

    fn release(&self, runner: &str) -> QueueFuture<'_, ()> {
        let runner = runner.to_owned();
        Box::pin(async move {
            {
                let mut index = self.lock();
                let mine: Vec<String> = index
                    .slots
                    .iter()
                    .filter(|(_, s)| {
                        s.partition == runner
                            || matches!(&s.state, SlotState::Out(Delivery::Reserved { runner: r, .. }) if *r == runner)
                    })
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in mine {
                    let state = index.slots.get(&id).map(|s| s.state.clone());
                    match state {
                        // A started call stays held; it only stops being this runner's.
                        Some(SlotState::Out(Delivery::Held { .. })) => {
                            if let Some(slot) = index.slots.get_mut(&id) {
                                slot.partition.clear();
                            }
                        }
                        Some(SlotState::Ready | SlotState::Out(Delivery::Reserved { .. })) => {
                            index.unlist(&id);
                            if let Some(slot) = index.slots.get_mut(&id) {
                                slot.partition.clear();
                                slot.state = SlotState::Pending;
                            }
                            index.make_ready(&id);
                        }
                        Some(SlotState::Pending) | None => {}
                    }
                }
            }
            self.arrived.notify_waiters();
            Ok(())
        })
    }

    fn missing(&self, ids: &[&str]) -> Option<Vec<String>> {
        let index = self.lock();
        Some(
            ids.iter()
                .filter(|id| !index.slots.contains_key(**id))
                .map(|id| id.to_string())
                .collect(),
        )
    }

    fn owners(&self) -> Vec<String> {
        let index = self.lock();
        let mut owners: std::collections::BTreeSet<&str> = index
            .slots
            .values()
            .map(|s| s.partition.as_str())
            .filter(|p| !p.is_empty())
            .collect();
        for s in index.slots.values() {
            if let SlotState::Out(Delivery::Reserved { runner, .. }) = &s.state {
                owners.insert(runner);
            }
        }
        owners.into_iter().map(str::to_owned).collect()
    }

    fn stats(&self) -> QueueStats {
        let index = self.lock();
        QueueStats {
            ready: index.ready.values().map(BTreeMap::len).sum(),
            reserved: index.out,
            ..QueueStats::default()
        }
    }
}
