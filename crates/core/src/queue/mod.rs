//! The call queue: where asynchronous calls wait for a runner.
//!
//! A [`Queue`] holds messages (a call id, the partition of the runner it is meant for, and the
//! encoded call) durably from [`Queue::put`] until [`Queue::delete`]. A runner [`Queue::reserve`]s
//! messages: each is handed to one runner at a time and comes back (is redelivered) if the runner
//! neither starts nor rejects it in time, or when the runner is declared gone
//! ([`Queue::release`]). A started call's message is [`Queue::hold`]en until the call's deadline,
//! so it is never redelivered while the call may still be running: a call that outlives its runner
//! ends `timeout`, not `error`.
//!
//! Two implementations pass one contract (`tests/queue.rs`): the embedded queue (RocksDB, the
//! default) and the Kafka queue (against Apache Kafka and against tansu), both `ebb-storage`'s;
//! the simulator has a third.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A message on the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The call id; unique on the queue.
    pub id: String,
    /// The runner the message is meant for (`""`: any runner).
    pub partition: String,
    /// The encoded call.
    pub body: Vec<u8>,
    /// How many times it has been handed to a runner, this delivery included.
    pub deliveries: u32,
    /// When it was put, where the queue keeps it (Kafka: the record's timestamp): a message of
    /// a call the log does not know that was put longer ago than any enqueue takes to record
    /// its call (`CallOptions::forgotten_after_ms`) is of a call the log forgot, read again.
    pub put_at_ms: Option<u64>,
}

impl Message {
    /// A new message (not yet delivered).
    pub fn new(id: impl Into<String>, partition: impl Into<String>, body: Vec<u8>) -> Self {
        Self {
            id: id.into(),
            partition: partition.into(),
            body,
            deliveries: 0,
            put_at_ms: None,
        }
    }
}

/// A queue operation that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// The storage or broker failed.
    #[error("queue storage failed: {0}")]
    Storage(String),
    /// The queue holds its maximum of messages.
    #[error("the queue is full ({0} messages)")]
    Full(usize),
    /// A message id was put twice.
    #[error("message {0} is already on the queue")]
    Duplicate(String),
}

/// The answer of a queue operation.
pub type QueueFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, QueueError>> + Send + 'a>>;

/// Counts for `ebb` stats and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Messages waiting for a runner.
    pub ready: usize,
    /// Messages handed to a runner (reserved or held).
    pub reserved: usize,
    /// Partitions the consumer group's rebalances gave this replica's runners' consumers since
    /// the queue opened (Kafka: each consumer's first assignment too); 0 where none move.
    pub partitions_assigned: u64,
    /// Partitions the rebalances took from them: a call on a partition that moves waits for its
    /// next consumer.
    pub partitions_revoked: u64,
}

/// A durable queue of call messages with per-runner partitions.
pub trait Queue: Send + Sync {
    /// Puts messages on the queue; returns once they are written (durable, unless the
    /// implementation says otherwise: see [`Queue::missing`]).
    fn put(&self, messages: Vec<Message>) -> QueueFuture<'_, ()>;

    /// Which of `ids` the queue does not hold, for a queue whose puts a machine crash may lose
    /// (the caller puts them again from its own durable record); `None` when every put is
    /// durable on its own or the queue cannot tell.
    fn missing(&self, ids: &[&str]) -> Option<Vec<String>> {
        let _ = ids;
        None
    }

    /// Hands up to `max` messages to `runner`: its own partition's first, then any runner's. Waits
    /// up to `wait` for one; an empty answer means none came.
    fn reserve(&self, runner: &str, max: usize, wait: Duration) -> QueueFuture<'_, Vec<Message>>;

    /// Keeps delivered messages from redelivery, each until its time (a started call's deadline).
    /// Unknown ids are ignored.
    fn hold(&self, holds: Vec<(String, u64)>) -> QueueFuture<'_, ()>;

    /// Removes messages for good (the call finished or its start was refused). Unknown ids are
    /// ignored.
    fn delete(&self, ids: Vec<String>) -> QueueFuture<'_, ()>;

    /// The runner is gone: the messages it reserved but did not start, and those meant for it, go
    /// to other runners.
    fn release(&self, runner: &str) -> QueueFuture<'_, ()>;

    /// Runners that messages are meant for or reserved by: after a restart, the ones that never
    /// come back are released.
    fn owners(&self) -> Vec<String>;

    /// Current counts.
    fn stats(&self) -> QueueStats;

    /// Whether the queue can be reached now (`/readyz`); the error says why not. A queue inside
    /// this process always can.
    fn reachable(&self) -> QueueFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    /// Whether a message's partition decides which runner reads it, so the call service may
    /// steer a call to the least-loaded runner by naming it. On Kafka it is only the message's
    /// key: the consumer group decides who reads which partition, and calls steered to a few
    /// runners' names would crowd onto their few partitions.
    fn steers_to_runners(&self) -> bool {
        true
    }
}
