//! The Kafka queue: calls on a topic with N partitions (rdkafka, bundled librdkafka).
//!
//! * [`Queue::put`] produces with `acks=all` and returns once the broker has every message; a
//!   message's key is the partition its enqueue named (calls sharing it share a Kafka
//!   partition). Calls without one go in runs of [`KEY_RUN`] (the producer batches each run
//!   onto one Kafka partition): onto the partitions this replica's own runners read, turn
//!   about, while one of them waits for work; else each run shares a key, so runs spread over
//!   every partition and every runner's consumer. A call read by a runner of the replica that
//!   enqueued it is decided there, without asking its owner for its state and forwarding its
//!   start and finish. ebb does not steer calls to runners by name here
//!   ([`Queue::steers_to_runners`]).
//! * Each runner that asks for work gets a consumer of its own in one consumer group, created on
//!   its first dequeue; the group spreads the partitions over the live runners, and when a runner
//!   is released its consumer leaves the group and its partitions move to the others.
//! * Offsets are committed only after finish or reject ([`Queue::delete`]): per partition, up to
//!   the oldest message still outstanding, asynchronously (a commit only saves a reread), at most
//!   once every `commit_every_ms` (a delete or a reserve past it commits) and when a runner's
//!   consumer leaves the group. A message read again (after a rebalance or a restart) whose call
//!   is handed out or held already is not handed out twice.
//! * Messages handed out are kept in memory until deleted, so a runner's reserved-but-not-started
//!   messages can go to another runner at once when it is released, and after the visibility
//!   timeout, without waiting for Kafka to redeliver them.
//! * A runner that stops asking for work (its capacity is full) gives up its consumer after
//!   `idle_consumer_ms`, so its partitions move to runners that ask instead of waiting for it.
//! * Holds live in memory: after a restart or a rebalance a started call's message is read
//!   again, and the call service holds it again from its owner's log (`CallStarted` and its
//!   deadline), never hands it out twice.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::DeliveryResult;
use rdkafka::producer::{BaseRecord, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

use ebb_core::clock::Clock;
use ebb_core::ids::IdKey;
use ebb_core::queue::{Message, Queue, QueueError, QueueFuture, QueueStats};

/// How many calls put together without a partition share a key (and so a Kafka partition).
pub const KEY_RUN: usize = 250;

/// The default [`KafkaOptions::commit_every_ms`].
pub const COMMIT_EVERY_MS: u64 = 100;

/// How to reach Kafka and shape the topic.
#[derive(Debug, Clone)]
pub struct KafkaOptions {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// The calls topic.
    pub topic: String,
    /// Partitions of the topic when ebb creates it.
    pub partitions: i32,
    /// The runners' consumer group.
    pub group: String,
    /// `session.timeout.ms` of the consumers: how soon a gone consumer's partitions move.
    pub session_timeout_ms: u32,
    /// How long a put may take before it fails.
    pub put_timeout_ms: u64,
    /// How long a runner may keep a message it did not start before another runner gets it.
    pub visibility_timeout_ms: u64,
    /// The most messages handed out and not yet deleted.
    pub max_out: usize,
    /// A runner that has not asked for work for this long (it is busy: its calls fill its
    /// capacity) gives up its consumer, so its partitions move to runners that ask; it joins
    /// again when it asks next.
    pub idle_consumer_ms: u64,
    /// Offsets are committed at most once in this long. Each commit is a request the broker
    /// writes to its offsets topic: committing after every finished batch wrote 4.6x the bytes
    /// there under `ebb bench calls` and cost the broker more CPU per call. A commit only saves
    /// a reread after a restart or a rebalance (the log refuses an ended call's start), so a
    /// later one loses nothing.
    pub commit_every_ms: u64,
    /// librdkafka properties for ebb's Kafka clients (TLS, SASL, batching, fetching), set after
    /// ebb's own: a key `producer.K` goes to the producer only, `consumer.K` to the runners'
    /// consumers only, any other to every client (the admin client too). See
    /// [`ClientProperties::parse`] for the keys ebb keeps.
    pub client: ClientProperties,
}

/// librdkafka properties given to ebb's Kafka clients (`--kafka-config`), sorted by the clients
/// they go to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientProperties {
    /// For every client.
    pub all: Vec<(String, String)>,
    /// For the producer only (given as `producer.K=V`).
    pub producer: Vec<(String, String)>,
    /// For the runners' consumers only (given as `consumer.K=V`).
    pub consumer: Vec<(String, String)>,
}

/// Properties ebb sets itself (or leaves at librdkafka's default) because its promises rest on
/// them: a put acknowledged only once every replica has it, exactly once, within its timeout,
/// calls sharing a key on one partition; a runner's consumer in ebb's one group, committing its
/// own offsets after finishes, reading a new group from the start, leaving the group when
/// released, its partitions moving a few at a time; and the brokers named by `--kafka-brokers`.
pub const KEPT_PROPERTIES: [&str; 16] = [
    "bootstrap.servers",
    "metadata.broker.list",
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "transactional.id",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "partitioner",
    "group.id",
    "group.instance.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "enable.partition.eof",
    "partition.assignment.strategy",
];

impl ClientProperties {
    /// Reads `KEY=VALUE` items, each as [`ClientProperties::add`] does.
    pub fn parse<'a>(items: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut out = Self::default();
        for item in items {
            out.add(item)?;
        }
        Ok(out)
    }

    /// Adds one `KEY=VALUE` item (spaces around the key and the value dropped); an item without
    /// `=`, with an empty key, or naming a property ebb keeps ([`KEPT_PROPERTIES`]) is refused
    /// with its reason (which never repeats the item: it may hold a password). Unknown keys and
    /// bad values are librdkafka's to refuse, when the clients are made.
    pub fn add(&mut self, item: &str) -> Result<(), String> {
        let Some((key, value)) = item.split_once('=') else {
            return Err("a property is not KEY=VALUE".to_owned());
        };
        let key = key.trim();
        let (to, name) = if let Some(k) = key.strip_prefix("producer.") {
            (&mut self.producer, k)
        } else if let Some(k) = key.strip_prefix("consumer.") {
            (&mut self.consumer, k)
        } else {
            (&mut self.all, key)
        };
        if name.is_empty() {
            return Err(format!("{key:?} names no property"));
        }
        if KEPT_PROPERTIES.contains(&name) {
            return Err(format!(
                "{name} is set by ebb itself (its calls' guarantees rest on it){}",
                if name == "bootstrap.servers" || name == "metadata.broker.list" {
                    ": name the brokers with --kafka-brokers"
                } else {
                    ""
                }
            ));
        }
        to.push((name.to_owned(), value.trim().to_owned()));
        Ok(())
    }

    /// `config` with the properties for every client and then `only`'s.
    fn apply(&self, mut config: ClientConfig, only: &[(String, String)]) -> ClientConfig {
        for (k, v) in self.all.iter().chain(only) {
            config.set(k, v);
        }
        config
    }
}

impl Default for KafkaOptions {
    fn default() -> Self {
        Self {
            brokers: "127.0.0.1:9092".into(),
            topic: "ebb-calls".into(),
            partitions: 8,
            group: "ebb-runners".into(),
            session_timeout_ms: 6_000,
            put_timeout_ms: 5_000,
            visibility_timeout_ms: 30_000,
            max_out: 1_000_000,
            idle_consumer_ms: 3_000,
            commit_every_ms: COMMIT_EVERY_MS,
            client: ClientProperties::default(),
        }
    }
}

/// What a Kafka message carries.
#[derive(Debug, Serialize, Deserialize)]
struct Envelope {
    id: String,
    partition: String,
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
}

impl Out {
    /// When the message is anyone's again.
    fn due_ms(self) -> u64 {
        match self {
            Out::Reserved { until_ms } | Out::Held { until_ms } => until_ms,
            Out::Free => 0,
        }
    }
}

impl Books {
    /// Changes an entry's state, keeping its timer.
    fn set_out(&mut self, id: &str, out: Out) {
        if let Some(e) = self.entries.get_mut(id) {
            if let Some(id) = self.timers.remove(&(e.out.due_ms(), e.serial)) {
                self.timers.insert((out.due_ms(), e.serial), id);
            }
            e.out = out;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// Handed to a runner until the time; then anyone's again.
    Reserved { until_ms: u64 },
    /// A started call's message, kept until the time.
    Held { until_ms: u64 },
    /// Its runner is gone: the next runner to ask gets it.
    Free,
}

#[derive(Debug)]
struct Entry {
    out: Out,
    /// Its place among the timers' entries of the same time.
    serial: u64,
    /// The runner it was last handed to (shared by the messages of one reserve).
    runner: Arc<str>,
    partition: String,
    body: Vec<u8>,
    deliveries: u32,
    /// The record's timestamp.
    put_at_ms: Option<u64>,
    /// Where it sits: (partition, offset).
    at: (i32, i64),
}

/// One partition's offsets read and not yet done, whichever consumer read them.
#[derive(Debug, Default)]
struct Tracker {
    outstanding: BTreeSet<i64>,
    /// Offsets done (deleted) before their partition was read up to them again.
    next: i64,
    /// The commit point last committed.
    committed: i64,
}

impl Tracker {
    fn seen(&mut self, offset: i64) {
        self.outstanding.insert(offset);
        self.next = self.next.max(offset + 1);
    }

    fn done(&mut self, offset: i64) {
        self.outstanding.remove(&offset);
    }

    /// Where consumption resumes: the oldest offset not done, or past the newest read.
    fn point(&self) -> i64 {
        self.outstanding.first().copied().unwrap_or(self.next)
    }
}

#[derive(Default)]
struct Books {
    /// Hashed with foldhash: every reserve, hold and delete looks up each of its ids here.
    /// Keyed by the id kept in place: no key to allocate, nor a pointer to follow per lookup.
    entries: HashMap<IdKey, Entry, foldhash::fast::RandomState>,
    /// Every entry's id once, by when it is anyone's again (free ones at 0) and its entry's
    /// serial: a timer moves without comparing or copying ids.
    timers: BTreeMap<(u64, u64), IdKey>,
    /// The serial of the last entry booked.
    serial: u64,
    trackers: HashMap<i32, Tracker>,
    consumers: HashMap<String, Arc<RunnerConsumer>>,
    /// Each runner's reserves under way and when it last asked.
    asking: HashMap<String, Asking>,
    /// When offsets were last committed.
    committed_ms: u64,
    /// Runs put onto this replica's own partitions so far: the next run's turn among them.
    turn: usize,
}

/// A runner's consumer.
type RunnerConsumer = StreamConsumer<Assigned>;

/// A runner's consumer's context: the partitions the group assigned it, as its rebalances said
/// (read on every put, without a request to librdkafka's thread as `assignment()` makes).
#[derive(Debug)]
struct Assigned {
    partitions: Mutex<BTreeSet<i32>>,
    /// The queue's count of partitions moved, shared by its consumers.
    moved: Arc<Moved>,
}

/// Partitions given to and taken from a queue's consumers by their rebalances.
#[derive(Debug, Default)]
struct Moved {
    assigned: AtomicU64,
    revoked: AtomicU64,
}

impl Assigned {
    fn partitions(&self) -> std::sync::MutexGuard<'_, BTreeSet<i32>> {
        self.partitions.lock().expect("assigned partitions lock")
    }
}

impl ClientContext for Assigned {
    // A commit sent while the group rebalances is refused (its generation is over); the offsets
    // are committed again after the rebalance, and a call read again meanwhile is deleted as
    // ended. librdkafka logs each refusal as a warning: here it is a debug line. Every other
    // line goes as librdkafka's default context logs it.
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        if is_stale_commit(fac, message) {
            tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}");
        } else {
            DefaultClientContext.log(level, fac, message);
        }
    }
}

/// Whether a librdkafka log line is a commit refused because the group's generation changed
/// under it (a rebalance), which the next commit after it covers.
fn is_stale_commit(fac: &str, message: &str) -> bool {
    fac == "COMMITFAIL"
        && (message.contains("generation id is not valid")
            || message.contains("rebalance in progress"))
}

impl ConsumerContext for Assigned {
    // Cooperative rebalances assign and revoke partitions a few at a time; an eager one revokes
    // them all, then assigns the new set. The consumer reads one topic, the calls'.
    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut partitions = self.partitions();
        match rebalance {
            Rebalance::Assign(tpl) => {
                partitions.extend(tpl.elements().iter().map(|e| e.partition()));
                self.moved
                    .assigned
                    .fetch_add(tpl.count() as u64, Ordering::Relaxed);
            }
            Rebalance::Revoke(tpl) => {
                for e in tpl.elements() {
                    partitions.remove(&e.partition());
                }
                self.moved
                    .revoked
                    .fetch_add(tpl.count() as u64, Ordering::Relaxed);
            }
            Rebalance::Error(_) => {}
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Asking {
    under_way: u32,
    last_ms: u64,
}

/// The producer's context: the records of one put share its [`Deliveries`], told of each
/// delivery on the producer's polling thread.
struct Delivered;

impl ClientContext for Delivered {}

impl ProducerContext for Delivered {
    type DeliveryOpaque = Arc<Deliveries>;

    fn delivery(&self, result: &DeliveryResult<'_>, put: Arc<Deliveries>) {
        put.done(1, result.as_ref().err().map(|(e, _)| e.clone()));
    }
}

/// One put's records still on their way to the broker, and the first failure among them. The
/// put waits for the last and is woken once, not once per record: a future and a channel per
/// record (rdkafka's `FutureProducer`) cost 5 % of ebb's CPU on the Kafka calls path.
struct Deliveries {
    left: AtomicUsize,
    failed: Mutex<Option<KafkaError>>,
    all: tokio::sync::Notify,
}

impl Deliveries {
    fn new(records: usize) -> Self {
        Self {
            left: AtomicUsize::new(records),
            failed: Mutex::new(None),
            all: tokio::sync::Notify::new(),
        }
    }

    /// `n` records are done with: delivered, or (with `error`) failed.
    fn done(&self, n: usize, error: Option<KafkaError>) {
        if let Some(e) = error {
            self.failed
                .lock()
                .expect("deliveries lock")
                .get_or_insert(e);
        }
        if self.left.fetch_sub(n, Ordering::AcqRel) == n {
            // A permit if the put is not waiting yet: it finds it when it does.
            self.all.notify_one();
        }
    }

    /// Waits for every record; the first failure, if any.
    async fn all_done(&self) -> Result<(), KafkaError> {
        while self.left.load(Ordering::Acquire) > 0 {
            self.all.notified().await;
        }
        match self.failed.lock().expect("deliveries lock").take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// How long a put waits when librdkafka's queue is full before it tries the record again (as
/// rdkafka's `FutureProducer` does), up to the put's timeout.
const QUEUE_FULL_RETRY: Duration = Duration::from_millis(100);

/// The Kafka queue.
pub struct KafkaQueue {
    producer: Arc<ThreadedProducer<Delivered>>,
    clock: Arc<dyn Clock>,
    options: KafkaOptions,
    books: Mutex<Books>,
    moved: Arc<Moved>,
}

impl std::fmt::Debug for KafkaQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaQueue")
            .field("brokers", &self.options.brokers)
            .field("topic", &self.options.topic)
            .finish()
    }
}

/// The settings of `runner`'s consumer: ebb's own, then those given for consumers.
fn consumer_config(options: &KafkaOptions, runner: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &options.brokers)
        .set("group.id", &options.group)
        .set("client.id", format!("ebb-runner-{runner}"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        // A runner joining or leaving moves only the partitions that change hands; with the
        // eager default every consumer stopped for the whole rebalance (measured: calls
        // stalled up to 1.5 s when a runner joined).
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", options.session_timeout_ms.to_string())
        .set("heartbeat.interval.ms", "500")
        // Hand calls over as soon as they are on the broker.
        .set("fetch.wait.max.ms", "5")
        .set("fetch.min.bytes", "1");
    options.client.apply(config, &options.client.consumer)
}

fn kafka(e: impl std::fmt::Display) -> QueueError {
    QueueError::Storage(format!("kafka: {e}"))
}

/// An admin client for `options`' brokers, with the properties every client gets.
fn admin(options: &KafkaOptions) -> Result<AdminClient<DefaultClientContext>, QueueError> {
    let mut admin = ClientConfig::new();
    admin.set("bootstrap.servers", &options.brokers);
    options.client.apply(admin, &[]).create().map_err(kafka)
}

/// An admin request's outcome for each name it named: each done, or already as it asked
/// (`already`); otherwise the first refusal, as `doing` that name.
fn each_done(
    results: Vec<Result<String, (String, RDKafkaErrorCode)>>,
    already: RDKafkaErrorCode,
    doing: &str,
) -> Result<(), QueueError> {
    match results
        .into_iter()
        .find_map(|r| r.err().filter(|(_, e)| *e != already))
    {
        Some((name, e)) => Err(kafka(format!("{doing} {name}: {e}"))),
        None => Ok(()),
    }
}

/// How often [`delete_topic_and_group`] asks again to delete a group that still has members.
const GROUP_EMPTY_POLL: Duration = Duration::from_millis(100);

/// Deletes `options`' topic, with every message on it, and its consumer group's committed
/// offsets: for a topic ebb made for a while (`ebb bench calls` makes one a setup), never for a
/// queue in use. A group that has no offsets, or a topic already gone, is not an error. A group
/// with members is asked again until it has none, within the consumers' session timeout and
/// 5 s: a consumer's leave reaches the group's coordinator after the consumer has closed (a
/// member gone without leaving is dropped by the broker at its session timeout); past that,
/// the group stays and the error says why.
pub async fn delete_topic_and_group(options: &KafkaOptions) -> Result<(), QueueError> {
    let admin = admin(options)?;
    let wait = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let topic = admin.delete_topics(&[options.topic.as_str()], &wait);
    let gone = RDKafkaErrorCode::UnknownTopicOrPartition;
    each_done(topic.await.map_err(kafka)?, gone, "deleting topic")?;
    let none = RDKafkaErrorCode::GroupIdNotFound;
    let within =
        Duration::from_millis(u64::from(options.session_timeout_ms)) + Duration::from_secs(5);
    let members = |r: &Result<String, (String, RDKafkaErrorCode)>| {
        matches!(r, Err((_, RDKafkaErrorCode::NonEmptyGroup)))
    };
    let asked = ebb_core::clock::Stopwatch::start();
    loop {
        let group = admin.delete_groups(&[options.group.as_str()], &wait);
        let results = group.await.map_err(kafka)?;
        if !results.iter().any(members) || asked.elapsed() >= within {
            return each_done(results, none, "deleting consumer group");
        }
        tokio::time::sleep(GROUP_EMPTY_POLL).await;
    }
}

impl KafkaQueue {
    /// Connects, creating the topic if it is missing.
    pub async fn open(clock: Arc<dyn Clock>, options: KafkaOptions) -> Result<Self, QueueError> {
        // The consumers are made on a runner's first dequeue: their settings are checked now,
        // so that a bad one stops ebb at its start rather than its first call.
        // (A client is made, not only its settings read: some settings are checked against
        // each other only then.)
        drop(
            consumer_config(&options, "check")
                .create::<BaseConsumer>()
                .map_err(kafka)?,
        );
        let admin = admin(&options)?;
        let topic = NewTopic::new(
            &options.topic,
            options.partitions,
            TopicReplication::Fixed(1),
        );
        let created = admin
            .create_topics(
                [&topic],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(kafka)?;
        each_done(
            created,
            RDKafkaErrorCode::TopicAlreadyExists,
            "creating topic",
        )?;
        let mut producer = ClientConfig::new();
        producer
            .set("bootstrap.servers", &options.brokers)
            .set("acks", "all")
            .set("linger.ms", "1")
            .set("message.timeout.ms", options.put_timeout_ms.to_string())
            .set("enable.idempotence", "true");
        let producer: ThreadedProducer<Delivered> = options
            .client
            .apply(producer, &options.client.producer)
            .create_with_context(Delivered)
            .map_err(kafka)?;
        Ok(Self {
            producer: Arc::new(producer),
            clock,
            options,
            books: Mutex::new(Books::default()),
            moved: Arc::default(),
        })
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().expect("kafka queue lock")
    }

    /// The runner's consumer, joining the group on first use.
    fn consumer(&self, runner: &str) -> Result<Arc<RunnerConsumer>, QueueError> {
        if let Some(c) = self.books().consumers.get(runner) {
            return Ok(c.clone());
        }
        let c: RunnerConsumer = consumer_config(&self.options, runner)
            .create_with_context(Assigned {
                partitions: Mutex::default(),
                moved: self.moved.clone(),
            })
            .map_err(kafka)?;
        c.subscribe(&[&self.options.topic]).map_err(kafka)?;
        let c = Arc::new(c);
        Ok(self
            .books()
            .consumers
            .entry(runner.to_owned())
            .or_insert(c)
            .clone())
    }

    /// Notes a reserve of `runner` under way until the guard is dropped.
    fn asking(&self, runner: &str) -> AskingGuard<'_> {
        let now = self.clock.now_ms();
        let mut books = self.books();
        let a = books.asking.entry(runner.to_owned()).or_default();
        a.under_way += 1;
        a.last_ms = now;
        AskingGuard {
            queue: self,
            runner: runner.to_owned(),
        }
    }

    /// A partition for each of `runs` runs of calls put here: the partitions that this
    /// replica's runners waiting for work now read, each run the next in turn; none (spread them
    /// by key) when no runner of this replica waits. A partition that moved since its last
    /// rebalance only sends a run to another replica's runners, who ask this one about it.
    fn own_partitions(&self, runs: usize) -> Vec<i32> {
        let mut books = self.books();
        let waiting = partitions_of(&books, true);
        if waiting.is_empty() {
            return Vec::new();
        }
        let first = books.turn;
        books.turn = books.turn.wrapping_add(runs);
        (0..runs)
            .map(|i| waiting[first.wrapping_add(i) % waiting.len()])
            .collect()
    }

    /// The partitions this replica's runners' consumers read now, as their rebalances said.
    pub fn assigned(&self) -> Vec<i32> {
        partitions_of(&self.books(), false)
    }

    /// The partitions read by this replica's runners that wait for work now (a reserve of
    /// theirs is under way): where a put sends calls that name no partition.
    pub fn waiting(&self) -> Vec<i32> {
        partitions_of(&self.books(), true)
    }

    /// Closes the consumers of runners that have not asked for work for `idle_consumer_ms`
    /// (busy ones): their partitions move to the consumers of runners that ask.
    async fn release_idle(&self) {
        let now = self.clock.now_ms();
        let idle: Vec<(String, Arc<RunnerConsumer>)> = {
            let mut books = self.books();
            let names: Vec<String> = books
                .consumers
                .keys()
                .filter(|r| {
                    books.asking.get(*r).is_none_or(|a| {
                        a.under_way == 0
                            && now.saturating_sub(a.last_ms) >= self.options.idle_consumer_ms
                    })
                })
                .cloned()
                .collect();
            if !names.is_empty() {
                self.commit(&mut books, Commit::Now);
            }
            names
                .into_iter()
                .filter_map(|r| {
                    books.asking.remove(&r);
                    books.consumers.remove(&r).map(|c| (r, c))
                })
                .collect()
        };
        for (runner, c) in idle {
            tracing::debug!(%runner, "a busy runner gives up its partitions");
            // Closing leaves the group; it blocks, so off the runtime.
            let _ = tokio::task::spawn_blocking(move || drop(c)).await;
        }
    }

    /// How long until the first message held in memory is due, when one is in the future (one
    /// due already was taken by the last [`KafkaQueue::take_known`], or is taken by the next).
    fn next_due_in_ms(&self) -> Option<u64> {
        let now = self.clock.now_ms();
        let books = self.books();
        let ((at, _), _) = books.timers.first_key_value()?;
        (*at > now).then(|| at - now)
    }

    /// Hands out messages already in memory: those whose runner is gone and those whose time is
    /// up.
    fn take_known(&self, runner: &Arc<str>, max: usize, now: u64) -> Vec<Message> {
        let until_ms = now + self.options.visibility_timeout_ms;
        let mut books = self.books();
        let due: Vec<IdKey> = books
            .timers
            .iter()
            .take_while(|((at, _), _)| *at <= now)
            .take(max)
            .map(|(_, id)| id.clone())
            .collect();
        let mut out = Vec::with_capacity(due.len());
        for id in due {
            books.set_out(&id, Out::Reserved { until_ms });
            let Some(e) = books.entries.get_mut(id.as_str()) else {
                continue;
            };
            e.runner = runner.clone();
            e.deliveries += 1;
            out.push(Message {
                id: id.to_string(),
                partition: e.partition.clone(),
                body: e.body.clone(),
                deliveries: e.deliveries,
                put_at_ms: e.put_at_ms,
            });
        }
        out
    }

    /// Books messages read from Kafka, under one lock of the books (a lock a message was 1.3 %
    /// of the call path's CPU, its release waking the tasks that waited for it); returns those
    /// to hand out.
    fn read_all(&self, runner: &Arc<str>, ms: &[impl rdkafka::Message]) -> Vec<Message> {
        if ms.is_empty() {
            return Vec::new();
        }
        let now_ms = self.clock.now_ms();
        let mut books = self.books();
        ms.iter()
            .filter_map(|m| self.read(&mut books, now_ms, runner, m))
            .collect()
    }

    /// Books a message read from Kafka; returns it when it is to be handed out.
    fn read(
        &self,
        books: &mut Books,
        now_ms: u64,
        runner: &Arc<str>,
        m: &impl rdkafka::Message,
    ) -> Option<Message> {
        let (partition, offset) = (m.partition(), m.offset());
        let payload = m.payload().unwrap_or(&[]);
        let put_at_ms = m
            .timestamp()
            .to_millis()
            .and_then(|t| u64::try_from(t).ok());
        let tracker = books.trackers.entry(partition).or_default();
        if offset < tracker.committed {
            return None; // done already
        }
        tracker.seen(offset);
        let env: Envelope = match rmp_serde::from_slice(payload) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(partition, offset, error = %e, "a kafka message is not an ebb message; skipping it");
                tracker.done(offset);
                return None;
            }
        };
        if let Some(e) = books.entries.get(env.id.as_str()) {
            // Read again after a rebalance (same place): handed out or held already. A second
            // copy elsewhere (a producer retry, an id put twice) is done at once.
            if e.at != (partition, offset)
                && let Some(t) = books.trackers.get_mut(&partition)
            {
                t.done(offset);
            }
            return None;
        }
        let until_ms = now_ms + self.options.visibility_timeout_ms;
        books.serial += 1;
        let serial = books.serial;
        let key = IdKey::from(&env.id);
        books.timers.insert((until_ms, serial), key.clone());
        books.entries.insert(
            key,
            Entry {
                out: Out::Reserved { until_ms },
                serial,
                runner: runner.clone(),
                partition: env.partition.clone(),
                body: env.body.clone(),
                deliveries: 1,
                put_at_ms,
                at: (partition, offset),
            },
        );
        Some(Message {
            id: env.id,
            partition: env.partition,
            body: env.body,
            deliveries: 1,
            put_at_ms,
        })
    }

    /// Commits every partition whose point moved, through the consumer that owns it now: one
    /// asynchronous commit per consumer for all its partitions, sent without waiting for the
    /// broker. A commit only saves a reread: a message read again after a commit that did not
    /// land is of a call the log has ended, and its start is refused and the message deleted;
    /// and the next commit of that partition covers it. A partition owned by nobody yet (a
    /// rebalance is under way) is committed on a later call. [`Commit::Due`] commits nothing
    /// before `commit_every_ms` passed since the last commit that sent something.
    fn commit(&self, books: &mut Books, when: Commit) {
        let now = self.clock.now_ms();
        if when == Commit::Due
            && now.saturating_sub(books.committed_ms) < self.options.commit_every_ms
        {
            return;
        }
        let work: Vec<(i32, i64)> = books
            .trackers
            .iter()
            .filter(|(_, t)| t.point() > t.committed)
            .map(|(p, t)| (*p, t.point()))
            .collect();
        if work.is_empty() {
            return;
        }
        let topic = &self.options.topic;
        let mut committed = Vec::new();
        for c in books.consumers.values() {
            let Ok(assigned) = c.assignment() else {
                continue;
            };
            let mine: Vec<i32> = assigned
                .elements_for_topic(topic)
                .iter()
                .map(|e| e.partition())
                .collect();
            let mut tpl = TopicPartitionList::new();
            let mut these = Vec::new();
            for (partition, offset) in work.iter().filter(|(p, _)| mine.contains(p)) {
                if tpl
                    .add_partition_offset(topic, *partition, Offset::Offset(*offset))
                    .is_ok()
                {
                    these.push((*partition, *offset));
                }
            }
            if these.is_empty() {
                continue;
            }
            match c.commit(&tpl, CommitMode::Async) {
                Ok(()) => committed.extend(these),
                Err(e) => tracing::debug!(error = %e, "commit failed"),
            }
        }
        if !committed.is_empty() {
            books.committed_ms = now;
        }
        for (partition, offset) in committed {
            if let Some(t) = books.trackers.get_mut(&partition) {
                t.committed = t.committed.max(offset);
            }
        }
    }
}

/// The partitions, sorted, that the consumers in `books` read now: of every runner, or only of
/// those `waiting` for work (a reserve under way).
fn partitions_of(books: &Books, waiting: bool) -> Vec<i32> {
    let mut out = BTreeSet::new();
    for (runner, c) in &books.consumers {
        if !waiting || books.asking.get(runner).is_some_and(|a| a.under_way > 0) {
            out.extend(c.context().partitions().iter().copied());
        }
    }
    out.into_iter().collect()
}

/// Where a put sends a record.
#[derive(Debug, Clone, Copy)]
enum Onto {
    /// Where its key (by place in the put's keys) hashes to.
    Key(usize),
    /// That partition.
    Partition(i32),
}

/// When [`KafkaQueue::commit`] commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Commit {
    /// Once `commit_every_ms` passed since the last commit: after a delete or on a reserve.
    Due,
    /// At once: a consumer is about to leave the group.
    Now,
}

/// A reserve under way (see [`KafkaQueue::asking`]).
struct AskingGuard<'a> {
    queue: &'a KafkaQueue,
    runner: String,
}

impl Drop for AskingGuard<'_> {
    fn drop(&mut self) {
        let now = self.queue.clock.now_ms();
        if let Some(a) = self.queue.books().asking.get_mut(&self.runner) {
            a.under_way = a.under_way.saturating_sub(1);
            a.last_ms = now;
        }
    }
}

impl Queue for KafkaQueue {
    fn put(&self, messages: Vec<Message>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            // Messages put together without a partition go in runs of KEY_RUN, each run onto one
            // Kafka partition (the producer batches it): one of this replica's own runners'
            // while one waits for work, else the one the run's key (the id of its first message)
            // hashes to, so runs spread over all partitions and so over every runner's consumer.
            // Each keyed record names its key by place in `keys`, so a run's key is copied once.
            let unnamed = messages.iter().filter(|m| m.partition.is_empty()).count();
            let own = self.own_partitions(unnamed.div_ceil(KEY_RUN));
            let mut keys: Vec<String> = Vec::new();
            let mut records: Vec<(Onto, Vec<u8>)> = Vec::with_capacity(messages.len());
            let mut in_run = 0;
            for m in messages {
                let onto = if m.partition.is_empty() {
                    let (run, starts_run) = (in_run / KEY_RUN, in_run % KEY_RUN == 0);
                    in_run += 1;
                    match own.get(run) {
                        Some(p) => Onto::Partition(*p),
                        None => {
                            if starts_run {
                                keys.push(m.id.clone());
                            }
                            Onto::Key(keys.len() - 1)
                        }
                    }
                } else {
                    keys.push(m.partition.clone());
                    Onto::Key(keys.len() - 1)
                };
                // Sized up front: the encoder would otherwise grow it from nothing.
                let mut payload =
                    Vec::with_capacity(m.body.len() + m.id.len() + m.partition.len() + 16);
                rmp_serde::encode::write(
                    &mut payload,
                    &Envelope {
                        id: m.id,
                        partition: m.partition,
                        body: m.body,
                    },
                )
                .map_err(kafka)?;
                records.push((onto, payload));
            }
            let topic = self.options.topic.as_str();
            let deliveries = Arc::new(Deliveries::new(records.len()));
            let since = self.clock.now_ms();
            'records: for (i, (onto, payload)) in records.iter().enumerate() {
                let record = BaseRecord::<str, [u8], _>::with_opaque_to(topic, deliveries.clone())
                    .payload(payload.as_slice());
                let mut record = match onto {
                    Onto::Key(k) => record.key(keys[*k].as_str()),
                    Onto::Partition(p) => record.partition(*p),
                };
                loop {
                    match self.producer.send(record) {
                        Ok(()) => break,
                        Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                            if self.clock.now_ms().saturating_sub(since)
                                < self.options.put_timeout_ms =>
                        {
                            record = back;
                            tokio::time::sleep(QUEUE_FULL_RETRY).await;
                        }
                        Err((e, _)) => {
                            // This record and those after it are never sent: the put fails
                            // once the ones before it are delivered or failed.
                            deliveries.done(records.len() - i, Some(e));
                            break 'records;
                        }
                    }
                }
            }
            deliveries.all_done().await.map_err(kafka)?;
            Ok(())
        })
    }

    fn reserve(&self, runner: &str, max: usize, wait: Duration) -> QueueFuture<'_, Vec<Message>> {
        let runner: Arc<str> = runner.into();
        Box::pin(async move {
            let _asking = self.asking(&runner);
            self.release_idle().await;
            // Deletes since the last commit that was due are committed now at the latest.
            self.commit(&mut self.books(), Commit::Due);
            let max = max.max(1);
            let mut got = self.take_known(&runner, max, self.clock.now_ms());
            if got.len() >= max {
                return Ok(got);
            }
            if self.books().entries.len() >= self.options.max_out {
                // Over the bound: nothing more is read until calls end.
                return Ok(got);
            }
            let consumer = self.consumer(&runner)?;
            let deadline = tokio::time::sleep(wait);
            tokio::pin!(deadline);
            // Read a batch at a time, booked under one lock.
            let mut read = Vec::new();
            while got.len() < max {
                // Once something came, take only what is already fetched. Until then, a message
                // held in memory whose time comes before the wait's end (one held back, or
                // whose runner's reservation ran out) is handed out when its time comes, not at
                // the end of the wait.
                let next = if got.is_empty() && read.is_empty() {
                    let due_in = self.next_due_in_ms();
                    tokio::select! {
                        m = consumer.recv() => Some(m),
                        () = &mut deadline => None,
                        () = tokio::time::sleep(Duration::from_millis(due_in.unwrap_or(0))),
                            if due_in.is_some() =>
                        {
                            got = self.take_known(&runner, max, self.clock.now_ms());
                            continue;
                        }
                    }
                } else {
                    // Polled once: a timer of no length would wait for the timer wheel's next
                    // tick (up to a millisecond) whenever nothing more is fetched, which every
                    // batch ends with.
                    consumer.recv().now_or_never()
                };
                let (m, failed) = match next {
                    Some(Ok(m)) => (Some(m), false),
                    Some(Err(e)) if got.is_empty() && read.is_empty() => return Err(kafka(e)),
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "kafka receive failed");
                        (None, true)
                    }
                    // The wait is over, or nothing more is fetched.
                    None => (None, false),
                };
                let ended = m.is_none();
                read.extend(m);
                // Booked once as many are read as would fill the batch, or no more came.
                if !ended && got.len() + read.len() < max {
                    continue;
                }
                let booked = read.len();
                got.extend(self.read_all(&runner, &read));
                read.clear();
                // If none of what was read is to be handed out (read again, or done), the wait
                // goes on.
                if ended && (failed || booked == 0 || !got.is_empty()) {
                    break;
                }
            }
            Ok(got)
        })
    }

    fn hold(&self, holds: Vec<(String, u64)>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut books = self.books();
            for (id, until_ms) in holds {
                books.set_out(&id, Out::Held { until_ms });
            }
            Ok(())
        })
    }

    fn delete(&self, ids: Vec<String>) -> QueueFuture<'_, ()> {
        Box::pin(async move {
            let mut books = self.books();
            for id in &ids {
                if let Some(e) = books.entries.remove(id.as_str()) {
                    books.timers.remove(&(e.out.due_ms(), e.serial));
                    if let Some(t) = books.trackers.get_mut(&e.at.0) {
                        t.done(e.at.1);
                    }
                }
            }
            self.commit(&mut books, Commit::Due);
            Ok(())
        })
    }

    fn release(&self, runner: &str) -> QueueFuture<'_, ()> {
        let runner = runner.to_owned();
        Box::pin(async move {
            let consumer = {
                let mut books = self.books();
                // What its partitions have done is committed while it owns them.
                self.commit(&mut books, Commit::Now);
                let theirs: Vec<IdKey> = books
                    .entries
                    .iter()
                    .filter(|(_, e)| *e.runner == *runner && matches!(e.out, Out::Reserved { .. }))
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in theirs {
                    books.set_out(&id, Out::Free);
                }
                books.asking.remove(&runner);
                books.consumers.remove(&runner)
            };
            // Closing leaves the group (the others get its partitions); it blocks, so off the
            // runtime.
            if let Some(c) = consumer {
                let _ = tokio::task::spawn_blocking(move || drop(c)).await;
            }
            Ok(())
        })
    }

    fn owners(&self) -> Vec<String> {
        // The consumer group moves a gone runner's partitions; nothing to release by name.
        Vec::new()
    }

    fn steers_to_runners(&self) -> bool {
        false
    }

    fn reachable(&self) -> QueueFuture<'_, ()> {
        let producer = self.producer.clone();
        let topic = self.options.topic.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let metadata = rdkafka::producer::Producer::client(&*producer)
                    .fetch_metadata(Some(&topic), Duration::from_millis(1_000))
                    .map_err(kafka)?;
                // A missing topic is an error of the topic's, not of the request.
                match metadata.topics().iter().find_map(|t| t.error()) {
                    Some(e) => Err(kafka(format!("topic {topic}: {e:?}"))),
                    None => Ok(()),
                }
            })
            .await
            .map_err(kafka)?
        })
    }

    fn stats(&self) -> QueueStats {
        let books = self.books();
        let reserved = books
            .entries
            .values()
            .filter(|e| !matches!(e.out, Out::Free))
            .count();
        QueueStats {
            ready: books.entries.len() - reserved,
            reserved,
            partitions_assigned: self.moved.assigned.load(Ordering::Relaxed),
            partitions_revoked: self.moved.revoked.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
        items
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn client_properties_go_to_the_clients_their_prefix_names() {
        let p = ClientProperties::parse([
            "security.protocol=SASL_SSL",
            "producer.linger.ms=5",
            "consumer.fetch.min.bytes=1024",
            " sasl.password = a=b ",
        ])
        .unwrap();
        assert_eq!(
            p.all,
            pairs(&[("security.protocol", "SASL_SSL"), ("sasl.password", "a=b")])
        );
        assert_eq!(p.producer, pairs(&[("linger.ms", "5")]));
        assert_eq!(p.consumer, pairs(&[("fetch.min.bytes", "1024")]));
        // Given after ebb's own, the user's setting is the one a client gets.
        let mut ours = ClientConfig::new();
        ours.set("linger.ms", "1").set("client.id", "ebb");
        let theirs = p.apply(ours, &p.producer);
        assert_eq!(theirs.get("linger.ms"), Some("5"));
        assert_eq!(theirs.get("client.id"), Some("ebb"));
        assert_eq!(theirs.get("security.protocol"), Some("SASL_SSL"));
    }

    #[test]
    fn client_properties_ebb_keeps_or_malformed_are_refused_with_their_reason() {
        for (item, reason) in [
            ("acks=1", "acks is set by ebb itself"),
            (
                "producer.enable.idempotence=false",
                "enable.idempotence is set by ebb",
            ),
            (
                "consumer.enable.auto.commit=true",
                "enable.auto.commit is set by ebb",
            ),
            ("group.id=other", "group.id is set by ebb"),
            (
                "consumer.auto.offset.reset=latest",
                "auto.offset.reset is set by ebb",
            ),
            (
                "producer.message.timeout.ms=0",
                "message.timeout.ms is set by ebb",
            ),
            ("bootstrap.servers=x:9092", "--kafka-brokers"),
            ("linger.ms", "is not KEY=VALUE"),
            ("=1", "names no property"),
            ("consumer.=1", "names no property"),
        ] {
            let err = ClientProperties::parse([item]).expect_err(item);
            assert!(err.contains(reason), "{item}: {err}");
        }
    }

    #[test]
    fn consumer_properties_librdkafka_refuses_fail_the_consumer_made_at_the_queues_open() {
        for (item, says) in [
            ("consumer.no.such.property=1", "no.such.property"),
            // Each is valid alone; together librdkafka refuses them when the client is made.
            ("consumer.fetch.max.bytes=1000", "fetch.max.bytes"),
        ] {
            let options = KafkaOptions {
                client: ClientProperties::parse([item]).unwrap(),
                ..KafkaOptions::default()
            };
            let err = consumer_config(&options, "r")
                .create::<BaseConsumer>()
                .map(|_| ())
                .expect_err(item);
            assert!(err.to_string().contains(says), "{item}: {err}");
        }
    }

    #[test]
    fn only_commits_refused_by_a_rebalance_are_stale() {
        // librdkafka's line for a commit that met a new generation (seen with two replicas).
        let stale = "Offset commit (manual) failed for 4/4 partition(s) in join-state wait-metadata: \
                     Broker: Specified group generation id is not valid: t[4]@20(Broker: Specified \
                     group generation id is not valid)";
        assert!(is_stale_commit("COMMITFAIL", stale));
        assert!(is_stale_commit(
            "COMMITFAIL",
            "Offset commit (manual) failed for 1/1 partition(s): Broker: Group rebalance in progress"
        ));
        // Any other failure of a commit, and the same words under another facility, stay warnings.
        assert!(!is_stale_commit(
            "COMMITFAIL",
            "Offset commit (manual) failed for 1/1 partition(s): Broker: Not coordinator"
        ));
        assert!(!is_stale_commit("FAIL", stale));
    }
}
