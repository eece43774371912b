//! `ebb bench cleaners`: the cleaner's pure core and loop on this machine, each against an anchor
//! measured in the same run.
//!
//! * The schedule of 100,000 cleaners: upserts into the projection and moves of their next
//!   evaluation, per second, against a `BinaryHeap` of as many `(time, id)` pairs; the
//!   projection's size (its snapshot) and the process' resident memory it took.
//! * CEL: evaluations per second of the cleaner proposal's own condition over ten Knative
//!   Revisions, against the same condition written in Rust over the same JSON.
//! * Lateness: cleaners whose TTLs pass over a few seconds, run by the loop on the system clock
//!   (a log in memory, targets from memory): how late each evaluation is against its planned
//!   time, against the lateness of a bare tokio timer for the same times.
//! * Log growth: a standing cleaner evaluated every second whose conditions never hold, over a
//!   simulated day, as events a day: recording only evaluations that find something new
//!   (ebb's default) against recording every evaluation.

use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use serde_json::json;

use ebb::cleaner::cel::{Conditions, Limits};
use ebb::cleaner::runtime::{self, Backend, Cleaners, Deleted, Options, Resolved};
use ebb::clock::{Clock, Stopwatch, SystemClock};
use ebb::event::{CleanerSpec, Envelope, Event, SCHEMA_VERSION};
use ebb::log::{Log, MemStore};
use ebb::state::State;

use super::percentile;

/// Arguments of `ebb bench cleaners`.
#[derive(Debug, Clone, clap::Args)]
pub struct CleanersBenchArgs {
    /// Cleaners in the schedule.
    #[arg(long, default_value_t = 100_000)]
    pub cleaners: u64,
    /// Seconds the CEL measurement runs.
    #[arg(long, default_value_t = 3)]
    pub seconds: u64,
    /// Cleaners whose TTLs pass during the lateness measurement (over `--spread-ms`).
    #[arg(long, default_value_t = 1_000)]
    pub timed: u64,
    /// The span their TTLs pass over, in ms.
    #[arg(long, default_value_t = 10_000)]
    pub spread_ms: u64,
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4_096)
}

fn env(seq: u64, at_ms: u64, event: Event) -> Envelope {
    Envelope {
        seq,
        at_ms,
        version: SCHEMA_VERSION,
        event,
    }
}

fn spec(i: u64, ttl_ms: u64, condition: &str) -> CleanerSpec {
    CleanerSpec {
        name: format!("ns/cleaner-{i}"),
        ttl_ms,
        retry_period_ms: 3_600_000,
        conditions: vec![condition.to_owned()],
        ..CleanerSpec::default()
    }
}

/// Ten Revisions, none of which lets the proposal's condition hold for long.
pub fn revisions() -> serde_json::Value {
    let items: Vec<serde_json::Value> = (0..10)
        .map(|i| {
            json!({
                "metadata": {
                    "name": format!("sfj-commit--account-{i:05}"),
                    "annotations": {"serving.knative.dev/routes": "sfj-a,preview-b"},
                },
                "status": {"conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": "2026-10-01T00:00:00Z"},
                    {"type": "Active", "status": "False", "lastTransitionTime": "2026-10-01T00:00:00Z"},
                ]},
            })
        })
        .collect();
    json!({ "items": items })
}

/// The proposal's condition in Rust, over the same JSON: the anchor.
fn native(revisions: &serde_json::Value, now_ms: i64) -> bool {
    let keep = revisions["items"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|r| {
            let routes = r["metadata"]["annotations"]["serving.knative.dev/routes"]
                .as_str()
                .unwrap_or_default();
            routes
                .split(',')
                .any(|route| !route.starts_with("sfj-") && !route.starts_with("preview-"))
                || r["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|c| c["type"] == "Active")
                    .any(|c| {
                        c["status"] == "True"
                            || chrono::DateTime::parse_from_rfc3339(
                                c["lastTransitionTime"].as_str().unwrap_or_default(),
                            )
                            .is_ok_and(|t| now_ms - t.timestamp_millis() < 360 * 3_600_000)
                    })
        });
    !keep
}

/// Targets from nowhere, deletions that succeed: the loop's own cost.
struct Nothing;

impl Backend for Nothing {
    fn resolve(&self, _: &CleanerSpec) -> Result<Resolved, String> {
        Ok(Resolved::default())
    }
    async fn begin(&self, _: &CleanerSpec, _: &[String]) -> Result<(), String> {
        Ok(())
    }
    async fn delete(&self, _: &CleanerSpec, _: &str) -> Result<Deleted, String> {
        Ok(Deleted::Deleted)
    }
    async fn finish(&self, _: &CleanerSpec) -> Result<(), String> {
        Ok(())
    }
    async fn report(&self, _: &str, _: &ebb::state::Cleaner, _: &[String]) {}
}

pub async fn run(args: CleanersBenchArgs) -> Result<()> {
    let n = args.cleaners;
    println!("Cleaners' schedule ({n} cleaners):");
    let rss0 = rss_bytes();
    let mut state = State::default();
    let t = Stopwatch::start();
    for i in 0..n {
        let e = env(
            i + 1,
            1_000,
            Event::CleanerUpserted {
                cleaner: Box::new(spec(i, 1_000 + (i * 7_919) % 86_400_000, "true")),
            },
        );
        state.apply(&e);
    }
    let upserts = n as f64 / t.elapsed().as_secs_f64();
    let rss = rss_bytes().saturating_sub(rss0);
    let snapshot = state.encode_snapshot().len();
    let t = Stopwatch::start();
    for i in 0..n {
        let e = env(
            n + i + 1,
            2_000,
            Event::CleanerEvaluated {
                name: format!("ns/cleaner-{i}"),
                result: false,
                next_at_ms: Some(5_000_000 + (i * 104_729) % 86_400_000),
                reason: "WaitingForConditions".into(),
                message: String::new(),
                results: vec![false],
                evaluations: 1,
                would_delete: Vec::new(),
                folded: 0,
            },
        );
        state.apply(&e);
    }
    let moves = n as f64 / t.elapsed().as_secs_f64();
    let t = Stopwatch::start();
    let mut popped = 0u64;
    while let Some((_, due)) = state
        .schedule
        .next_of(ebb::state::schedule::DueKind::CleanerEval)
    {
        let due = due.clone();
        state.schedule.clear(&due);
        popped += 1;
    }
    let pops = popped as f64 / t.elapsed().as_secs_f64();
    // The anchor: a bare binary heap of as many (time, id) pairs.
    let t = Stopwatch::start();
    let mut heap = BinaryHeap::new();
    for i in 0..n {
        heap.push(std::cmp::Reverse(((i * 104_729) % 86_400_000, i)));
    }
    let pushes = n as f64 / t.elapsed().as_secs_f64();
    let t = Stopwatch::start();
    while heap.pop().is_some() {}
    let heap_pops = n as f64 / t.elapsed().as_secs_f64();
    println!(
        "  upserts into the projection: {upserts:.0}/s; moves of the next evaluation (CleanerEvaluated applied): {moves:.0}/s; earliest taken off: {pops:.0}/s"
    );
    println!(
        "  anchor, a bare BinaryHeap<(u64, u64)>: pushes {pushes:.0}/s, pops {heap_pops:.0}/s; ratio moves/pushes {:.3}",
        moves / pushes
    );
    println!(
        "  memory: {:.1} MiB resident for the projection ({:.0} bytes a cleaner), snapshot {:.1} MiB",
        rss as f64 / 1_048_576.0,
        rss as f64 / n as f64,
        snapshot as f64 / 1_048_576.0
    );

    println!("CEL: the cleaner proposal's condition over 10 Knative Revisions:");
    let revisions = revisions();
    let t = Stopwatch::start();
    let compiled =
        Conditions::compile(&[ebb::cleaner::PROPOSAL_EXAMPLE.to_owned()], &["revisions"])
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    let compile_us = t.elapsed().as_secs_f64() * 1e6;
    let now = SystemClock.now_ms();
    let mut bound = compiled.bind(&[("revisions", &revisions)]);
    let want = native(&revisions, now as i64);
    let t = Stopwatch::start();
    let mut evals = 0u64;
    while t.elapsed() < Duration::from_secs(args.seconds) {
        for _ in 0..100 {
            let r = bound
                .evaluate(now, Limits::default())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            assert_eq!(r, vec![want]);
        }
        evals += 100;
    }
    let cel = evals as f64 / t.elapsed().as_secs_f64();
    let t = Stopwatch::start();
    let mut natives = 0u64;
    while t.elapsed() < Duration::from_secs(args.seconds) {
        for _ in 0..100 {
            assert_eq!(native(std::hint::black_box(&revisions), now as i64), want);
        }
        natives += 100;
    }
    let rust = natives as f64 / t.elapsed().as_secs_f64();
    println!(
        "  {cel:.0} evaluations/s ({:.1} µs each, {} comprehension steps); compiled once in {compile_us:.0} µs",
        1e6 / cel,
        bound.steps()
    );
    println!(
        "  anchor, the same condition in Rust over the same JSON: {rust:.0}/s; ratio {:.3}",
        cel / rust
    );

    println!(
        "Lateness: {} cleaners falling due over {} ms, run by the loop on the system clock:",
        args.timed, args.spread_ms
    );
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store: Arc<dyn ebb::log::LogStore> = Arc::new(MemStore::new());
    let log = Arc::new(Log::<State>::open(
        store.clone(),
        ebb::log::Options::default(),
        clock.clone(),
        &mut |_| {},
    )?);
    let cleaners = Arc::new(Cleaners::new(
        log.clone(),
        clock.clone(),
        Arc::new(Nothing),
        Options::default(),
    ));
    let start = clock.now_ms() + 500;
    let mut planned = std::collections::HashMap::new();
    for i in 0..args.timed {
        let at = start + i * args.spread_ms / args.timed.max(1);
        let mut s = spec(i, at - start + 500, "true");
        s.created_at_ms = start - 500;
        planned.insert(s.name.clone(), at);
        cleaners.upsert(s).await?;
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (_nudge, nudges) = tokio::sync::mpsc::channel(1);
    let task = tokio::spawn(runtime::run(cleaners.clone(), nudges, stop_rx));
    let everyone = args.timed as usize;
    log.wait_until(
        Duration::from_millis(args.spread_ms + 30_000),
        |s: &State| {
            s.cleaners
                .by_name
                .values()
                .filter(|c| c.fired_at_ms.is_some())
                .count()
                == everyone
        },
    )
    .await;
    let _ = stop_tx.send(true);
    let _ = task.await;
    let mut late: Vec<f64> = Vec::new();
    let mut early = 0;
    ebb::log::read_envelopes(store.as_ref(), 1, log.applied_seq(), &mut |e, _| {
        if let Event::CleanerEvaluated { name, .. } = &e.event
            && let Some(at) = planned.get(name)
        {
            if e.at_ms < *at {
                early += 1;
            }
            late.push(e.at_ms.saturating_sub(*at) as f64);
        }
        true
    })?;
    late.sort_by(f64::total_cmp);
    // The anchor: a bare tokio timer for the same planned times.
    let mut bare: Vec<f64> = Vec::new();
    let start = clock.now_ms() + 500;
    for i in 0..args.timed {
        let at = start + i * args.spread_ms / args.timed.max(1);
        let wait = at.saturating_sub(clock.now_ms());
        tokio::time::sleep(Duration::from_millis(wait)).await;
        bare.push(clock.now_ms().saturating_sub(at) as f64);
    }
    bare.sort_by(f64::total_cmp);
    println!(
        "  {} evaluated, {early} early: late by p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        late.len(),
        percentile(&late, 0.5),
        percentile(&late, 0.99),
        late.last().copied().unwrap_or(0.0)
    );
    println!(
        "  anchor, a bare tokio timer for the same times: p50 {:.0} ms, p99 {:.0} ms",
        percentile(&bare, 0.5),
        percentile(&bare, 0.99)
    );
    drop(cleaners);
    if let Ok(log) = Arc::try_unwrap(log) {
        log.close();
    }
    log_growth().await
}

/// Events a day a standing cleaner evaluated every second writes, over a simulated day.
async fn log_growth() -> Result<()> {
    const DAY: u64 = 86_400_000;
    println!("Log growth, a standing cleaner evaluated every second (its conditions never hold):");
    let mut per_day = Vec::new();
    for fold in [false, true] {
        let t0 = 1_795_132_800_000;
        let clock = ebb::clock::SimClock::new(t0);
        let store: Arc<dyn ebb::log::LogStore> = Arc::new(MemStore::new());
        let log = Arc::new(Log::<State>::open(
            store.clone(),
            ebb::log::Options::default(),
            Arc::new(clock.clone()),
            &mut |_| {},
        )?);
        let cleaners = Cleaners::new(
            log.clone(),
            Arc::new(clock.clone()),
            Arc::new(Nothing),
            Options {
                fold_unchanged: fold,
                max_per_second: u32::MAX,
                ..Options::default()
            },
        );
        let mut s = spec(0, 1_000, "false");
        s.retry_period_ms = 1_000;
        s.created_at_ms = t0;
        cleaners.upsert(s).await?;
        let before = log.applied_seq();
        let mut now = t0;
        let mut evaluated = 0u64;
        while now < t0 + DAY {
            clock.set(now);
            evaluated += cleaners.evaluate_due(1_000).await?.len() as u64;
            now = cleaners.next_due().map_or(now + 1_000, |d| d.max(now + 1));
        }
        let events = log.applied_seq() - before;
        per_day.push(events);
        println!(
            "  {}: {evaluated} evaluations, {events} events in the day",
            if fold {
                "recording what changed (ebb)"
            } else {
                "anchor, recording every evaluation"
            },
        );
        drop(cleaners);
        if let Ok(log) = Arc::try_unwrap(log) {
            log.close();
        }
    }
    println!(
        "  ratio: {:.5}x the anchor's events",
        per_day[1] as f64 / per_day[0].max(1) as f64
    );
    Ok(())
}
