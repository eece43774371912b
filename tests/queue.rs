//! The queue contract: what every [`Queue`] promises, run against each implementation.

use std::sync::Arc;
use std::time::Duration;

use ebb::clock::{Clock, SystemClock};
use ebb::queue::embedded::{EmbeddedOptions, EmbeddedQueue};
use ebb::queue::{Message, Queue};

const WAIT: Duration = Duration::from_secs(10);

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
async fn contract(open: impl Fn() -> Arc<dyn Queue>) {
    let q = open();
    // Order, bodies, delivery counts.
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
    assert_eq!(got[0].body, b"body of a1");
    assert!(got.iter().all(|m| m.deliveries == 1));
    // b's message is b's; nothing else is ready for a.
    let none = q
        .reserve("a", 10, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(none.is_empty(), "{:?}", ids(&none));
    let got = reserve_n(&*q, "b", 1).await;
    assert_eq!(ids(&got), ["b1"]);

    // A put wakes a waiting runner.
    let waiter = {
        let q = q.clone();
        tokio::spawn(async move { q.reserve("c", 1, WAIT).await.unwrap() })
    };
    tokio::task::yield_now().await;
    q.put(vec![msg("c1", "c")]).await.unwrap();
    let got = waiter.await.unwrap();
    assert_eq!(ids(&got), ["c1"]);

    // Released runners' messages go to others: reserved-but-not-started ones and queued ones;
    // held (started) ones do not.
    q.put(vec![msg("a3", "a")]).await.unwrap();
    q.hold(vec![("a1".into(), u64::MAX)]).await.unwrap();
    q.release("a").await.unwrap();
    let mut got = reserve_n(&*q, "d", 3).await;
    got.sort_by(|x, y| x.id.cmp(&y.id));
    assert_eq!(ids(&got), ["a2", "a3", "s1"]);
    assert_eq!(
        got.iter().find(|m| m.id == "a2").unwrap().deliveries,
        2,
        "a2 is on its second delivery"
    );

    // Deleted messages are gone; the rest survive a reopen.
    q.delete(vec![
        "a2".into(),
        "a3".into(),
        "s1".into(),
        "c1".into(),
        "nope".into(),
    ])
    .await
    .unwrap();
    drop(got);
    drop(q);
    let q = open();
    q.release("b").await.unwrap();
    q.release("d").await.unwrap();
    let got = reserve_n(&*q, "e", 1).await;
    assert_eq!(ids(&got), ["b1"], "b1 survived, a1 is still held");
    q.delete(vec!["a1".into(), "b1".into()]).await.unwrap();
    let none = q
        .reserve("e", 10, Duration::from_millis(200))
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
    contract(|| embedded(&path, EmbeddedOptions::default())).await;
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
