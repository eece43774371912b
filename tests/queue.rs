//! The queue contract: what every [`Queue`] promises, run against each implementation.

use std::sync::Arc;
use std::time::Duration;

use ebb::clock::{Clock, SystemClock};
use ebb::queue::embedded::{EmbeddedOptions, EmbeddedQueue};
use ebb::queue::kafka::{KafkaOptions, KafkaQueue};

use crate::common;
use ebb::queue::{Message, Queue};

const WAIT: Duration = Duration::from_secs(30);

fn msg(id: &str, partition: &str) -> Message {
    Message::new(id, partition, format!("body of {id}").into_bytes())
}

fn ids(got: &[Message]) -> Vec<&str> {
    got.iter().map(|m| m.id.as_str()).collect()
}

/// Reserves until `n` messages came (or the wait ran out).
async fn reserve_n(q: &dyn Queue, runner: &str, n: usize) -> Vec<Message> {
    let mut got = Vec::new();
    let clock = ebb::clock::Stopwatch::start();
    while got.len() < n && clock.elapsed() < WAIT {
        got.extend(
            q.reserve(runner, n - got.len(), Duration::from_millis(500))
                .await
                .unwrap(),
        );
    }
    got
}

/// The contract. `open` opens the queue over the same storage each time it is called (the
/// previous one is dropped first).
async fn contract(open: impl AsyncFn() -> Arc<dyn Queue>) {
    let q = open().await;
    // Every message once, bodies intact.
    q.put(vec![msg("x1", ""), msg("x2", ""), msg("x3", "")])
        .await
        .unwrap();
    let mut got = reserve_n(&*q, "r1", 3).await;
    got.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(ids(&got), ["x1", "x2", "x3"]);
    assert_eq!(got[0].body, b"body of x1");
    assert!(got.iter().all(|m| m.deliveries == 1));
    let none = q
        .reserve("r1", 10, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(none.is_empty(), "{:?}", ids(&none));

    // A released runner's messages go to another runner, except a held (started) one.
    q.hold(vec![("x1".into(), u64::MAX)]).await.unwrap();
    q.release("r1").await.unwrap();
    let mut got = reserve_n(&*q, "r2", 2).await;
    got.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(ids(&got), ["x2", "x3"]);
    assert!(got.iter().all(|m| m.deliveries == 2), "{got:?}");
    let none = q
        .reserve("r2", 10, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(none.is_empty(), "{:?}", ids(&none));

    // A put wakes a waiting runner.
    let waiter = {
        let q = q.clone();
        tokio::spawn(async move { q.reserve("r2", 1, WAIT).await.unwrap() })
    };
    tokio::task::yield_now().await;
    q.put(vec![msg("y1", "")]).await.unwrap();
    assert_eq!(ids(&waiter.await.unwrap()), ["y1"]);

    // Deleted messages are gone for good; the others survive a reopen.
    q.delete(vec![
        "x1".into(),
        "x2".into(),
        "x3".into(),
        "y1".into(),
        "nope".into(),
    ])
    .await
    .unwrap();
    q.put(vec![msg("z1", ""), msg("z2", "")]).await.unwrap();
    drop(got);
    drop(q);
    let q = open().await;
    let mut got = reserve_n(&*q, "r3", 2).await;
    got.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(ids(&got), ["z1", "z2"]);
    q.delete(vec!["z1".into(), "z2".into()]).await.unwrap();
    let none = q
        .reserve("r3", 10, Duration::from_millis(500))
        .await
        .unwrap();
    assert!(none.is_empty(), "{:?}", ids(&none));
}

fn embedded(dir: &std::path::Path, options: EmbeddedOptions) -> Arc<dyn Queue> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    Arc::new(EmbeddedQueue::open(dir, clock, options).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_queue_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue");
    contract(async || embedded(&path, EmbeddedOptions::default())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_queue_hands_a_runner_its_own_partition_first() {
    let dir = tempfile::tempdir().unwrap();
    let q = embedded(&dir.path().join("queue"), EmbeddedOptions::default());
    q.put(vec![
        msg("a1", "a"),
        msg("s1", ""),
        msg("a2", "a"),
        msg("b1", "b"),
    ])
    .await
    .unwrap();
    let got = reserve_n(&*q, "a", 3).await;
    assert_eq!(
        ids(&got),
        ["a1", "a2", "s1"],
        "own partition first, then any runner's"
    );
    let none = q
        .reserve("a", 10, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(none.is_empty(), "b's message is b's: {:?}", ids(&none));
    // Once b is gone, its messages are anyone's.
    q.release("b").await.unwrap();
    assert_eq!(ids(&reserve_n(&*q, "a", 1).await), ["b1"]);
}

/// A Kafka queue with `options`, on the system clock.
/// The Kafka queue's options on `broker`, with a topic of `partitions` partitions.
fn on(broker: &common::kafka::Broker, partitions: i32) -> KafkaOptions {
    KafkaOptions {
        brokers: broker.addr.to_string(),
        partitions,
        ..KafkaOptions::default()
    }
}

async fn kafka(options: &KafkaOptions) -> Arc<KafkaQueue> {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    Arc::new(KafkaQueue::open(clock, options.clone()).await.unwrap())
}

async fn kafka_contract(broker: &common::kafka::Broker) {
    let options = on(broker, 4);
    contract(async || kafka(&options).await as Arc<dyn Queue>).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_queue_keeps_the_contract_on_apache_kafka() {
    kafka_contract(&common::broker().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_queue_keeps_the_contract_on_tansu() {
    kafka_contract(&common::kafka::tansu_broker().await).await;
}

/// On Kafka, what is deleted is committed at most once per `commit_every_ms` (a commit is a
/// write on the broker's offsets topic; it only saves rereading what was deleted), and when a
/// runner's consumer leaves the group: a queue opened after a drop rereads what was deleted since
/// the last commit, and one opened after a release rereads nothing deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_queue_commits_once_an_interval_and_when_a_runner_leaves() {
    let broker = common::broker().await;
    let options = KafkaOptions {
        commit_every_ms: 3_600_000,
        ..on(&broker, 1)
    };
    let q = kafka(&options).await;
    q.put(vec![msg("a", ""), msg("b", ""), msg("c", "")])
        .await
        .unwrap();
    assert_eq!(ids(&reserve_n(&*q, "r", 3).await), ["a", "b", "c"]);
    // The first delete commits; the second, within the interval, does not.
    q.delete(vec!["a".into()]).await.unwrap();
    q.delete(vec!["b".into()]).await.unwrap();
    drop(q);
    let q = kafka(&options).await;
    assert_eq!(ids(&reserve_n(&*q, "r", 2).await), ["b", "c"]);
    q.delete(vec!["b".into()]).await.unwrap();
    q.delete(vec!["c".into()]).await.unwrap();
    // The runner leaves: its consumer commits the delete of c on its way out.
    q.release("r").await.unwrap();
    drop(q);
    // On the one partition, a reread c would come before d.
    let q = kafka(&options).await;
    q.put(vec![msg("d", "")]).await.unwrap();
    assert_eq!(ids(&reserve_n(&*q, "r", 1).await), ["d"]);
}

/// Deleting a Kafka queue's topic and group (what `ebb bench calls` does when a setup ends) waits
/// for the group's last member to leave: a consumer's leave reaches the broker after the consumer
/// closed, and a group asked for while a member was still in it stayed on the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_kafka_queue_waits_for_its_group_to_empty() {
    let broker = common::broker().await;
    // The deletion asks for the group for up to the session timeout and 5 s.
    let options = KafkaOptions {
        session_timeout_ms: 30_000,
        ..on(&broker, 1)
    };
    let q = kafka(&options).await;
    q.put(vec![msg("a", "")]).await.unwrap();
    // Runner r's consumer is in the group, given the one partition: it read a.
    assert_eq!(ids(&reserve_n(&*q, "r", 1).await), ["a"]);
    assert_eq!(q.stats().partitions_assigned, 1);
    let deleting = tokio::spawn({
        let options = options.clone();
        async move { ebb::queue::kafka::delete_topic_and_group(&options).await }
    });
    // The topic goes first; the group is asked for next, with r's consumer still in it.
    let (broker, topic) = (&broker, &options.topic);
    common::controlplane::wait_until("the topic deleted", WAIT, || async move {
        (!broker.names().await?.topics.contains(topic)).then_some(())
    })
    .await;
    assert!(!deleting.is_finished());
    // r's consumer leaves the group as the queue closes.
    tokio::task::spawn_blocking(move || drop(q)).await.unwrap();
    deleting.await.unwrap().unwrap();
    let names = broker.names().await.expect("the broker answers");
    assert!(!names.groups.contains(&options.group), "the group is gone");
}

/// On Kafka, a put whose record the producer refuses before sending (one larger than
/// `message.max.bytes`) fails, after the records before it were delivered and without sending
/// those after it; the next put works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_queue_fails_a_put_with_a_record_the_producer_refuses() {
    let broker = common::broker().await;
    let options = on(&broker, 1);
    let q = kafka(&options).await;
    let huge = Message::new("huge", "", vec![b'x'; 2_000_000]);
    let put = q.put(vec![msg("before", ""), huge, msg("after", "")]).await;
    let err = put
        .expect_err("a record over message.max.bytes")
        .to_string();
    assert!(err.contains("too large"), "{err}");
    assert_eq!(ids(&reserve_n(&*q, "r", 1).await), ["before"]);
    q.put(vec![msg("next", "")]).await.unwrap();
    // On the one partition, "after" would come before "next" had it been sent.
    assert_eq!(ids(&reserve_n(&*q, "r", 1).await), ["next"]);
}

/// On Kafka, calls put on a replica (a queue) without a partition go onto the partitions its own
/// runners read while one of them waits for work, so the replica that enqueued a call is the one
/// whose runner gets it: two queues in one group, each with a runner, each get back only what
/// was put on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_queue_puts_a_replicas_calls_where_its_own_waiting_runners_read() {
    let broker = common::broker().await;
    let options = on(&broker, 4);
    let (one, two) = (kafka(&options).await, kafka(&options).await);
    // Each queue's runner joins the group and asks until the group split the partitions.
    let watch = ebb::clock::Stopwatch::start();
    loop {
        let wait = Duration::from_millis(300);
        let (a, b) = tokio::join!(one.reserve("a", 1, wait), two.reserve("b", 1, wait));
        assert!(a.unwrap().is_empty() && b.unwrap().is_empty());
        let (mine, theirs) = (one.assigned(), two.assigned());
        if !mine.is_empty() && !theirs.is_empty() && mine.len() + theirs.len() == 4 {
            assert!(
                mine.iter().all(|p| !theirs.contains(p)),
                "{mine:?} {theirs:?}"
            );
            break;
        }
        assert!(
            watch.elapsed() < WAIT,
            "the group never split: {mine:?} {theirs:?}"
        );
    }
    for (q, runner, prefix) in [(&one, "a", "one"), (&two, "b", "two")] {
        let names: Vec<String> = (0..20).map(|i| format!("{prefix}-{i:02}")).collect();
        let asking = tokio::spawn({
            let q = q.clone();
            async move {
                // Waits, as a runner with room does, until something comes.
                let mut got = q.reserve(runner, 20, WAIT).await.unwrap();
                got.extend(reserve_n(&*q, runner, 20 - got.len()).await);
                got
            }
        });
        let watch = ebb::clock::Stopwatch::start();
        while q.waiting() != q.assigned() {
            assert!(watch.elapsed() < WAIT, "runner {runner} never waited");
            tokio::task::yield_now().await;
        }
        q.put(names.iter().map(|n| msg(n, "")).collect())
            .await
            .unwrap();
        let mut got = asking.await.unwrap();
        got.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(
            ids(&got),
            names,
            "runner {runner} got what was put beside it"
        );
        q.delete(names).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_queue_redelivers_after_the_visibility_timeout_and_holds_started_calls() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("queue");
    let options = EmbeddedOptions {
        visibility_timeout_ms: 300,
        ..EmbeddedOptions::default()
    };
    let q = embedded(&path, options.clone());
    q.put(vec![msg("x", "r"), msg("y", "r")]).await.unwrap();
    let got = reserve_n(&*q, "r", 2).await;
    assert_eq!(ids(&got), ["x", "y"]);
    q.hold(vec![("y".into(), u64::MAX)]).await.unwrap();
    // x was not started: it comes back, to the same runner, on its second delivery; y does not.
    let again = reserve_n(&*q, "r", 1).await;
    assert_eq!(ids(&again), ["x"]);
    assert_eq!(again[0].deliveries, 2);
    q.hold(vec![("x".into(), u64::MAX)]).await.unwrap();
    let none = q
        .reserve("r", 10, Duration::from_millis(600))
        .await
        .unwrap();
    assert!(none.is_empty(), "{:?}", ids(&none));
    // Reservations survive a reopen (ebb restarting must not hand out what a runner still has).
    drop(q);
    let q = embedded(&path, options);
    let stats = q.stats();
    assert_eq!((stats.ready, stats.reserved), (0, 2), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_queue_names_the_messages_it_does_not_hold() {
    let dir = tempfile::tempdir().unwrap();
    let q = embedded(&dir.path().join("queue"), EmbeddedOptions::default());
    q.put(vec![msg("a", ""), msg("b", "r")]).await.unwrap();
    q.delete(vec!["b".into()]).await.unwrap();
    assert_eq!(
        q.missing(&["a", "b", "c"]),
        Some(vec!["b".to_owned(), "c".to_owned()])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_queue_refuses_beyond_its_bound_and_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let q = embedded(
        &dir.path().join("queue"),
        EmbeddedOptions {
            max_messages: 2,
            ..EmbeddedOptions::default()
        },
    );
    q.put(vec![msg("1", "")]).await.unwrap();
    assert!(matches!(
        q.put(vec![msg("1", "")]).await,
        Err(ebb::queue::QueueError::Duplicate(_))
    ));
    assert!(matches!(
        q.put(vec![msg("2", ""), msg("3", "")]).await,
        Err(ebb::queue::QueueError::Full(2))
    ));
    assert_eq!(q.stats().ready, 1, "a refused put leaves nothing behind");
}
