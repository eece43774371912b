//! Property tests of the core: the codec, replay equivalence (from scratch, from any snapshot, and
//! live), and the call state machine.

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use serde_bytes::ByteBuf;

use ebb::clock::SimClock;
use ebb::event::{
    CallKind, CallResult, CallSpec, CleanerSpec, CleanerTarget, Envelope, Event, Outcome, Payload,
    ProcessSpec, RejectReason, RouteSpec, SCHEMA_VERSION, ScaleReason, TemplateSpec, decode,
    encode,
};
use ebb::log::rocks::OpenMode;
use ebb::log::{
    Durability, Log, LogStore, MemStore, Options, RocksStore, open_state, replay_range,
};
use ebb::state::calls::{decide_finish, decide_start, decide_timeouts};
use ebb::state::{CallStatus, StartVerdict, State};
use proptest::strategy::ValueTree;

fn name() -> impl Strategy<Value = String> {
    prop_oneof![Just("a"), Just("b"), Just("c"), Just("d")].prop_map(String::from)
}

fn text() -> impl Strategy<Value = String> {
    "[a-z0-9./*-]{0,12}"
}

fn bytes() -> impl Strategy<Value = ByteBuf> {
    proptest::collection::vec(any::<u8>(), 0..16).prop_map(ByteBuf::from)
}

fn headers() -> impl Strategy<Value = Vec<(String, String)>> {
    proptest::collection::vec((text(), text()), 0..3)
}

fn route_spec() -> impl Strategy<Value = RouteSpec> {
    (
        name(),
        proptest::collection::vec(
            prop_oneof![Just("x.test"), Just("*.y.test"), Just("z.test")],
            0..3,
        ),
        name(),
        0u64..10_000,
        0u32..3,
        1u32..5,
        any::<u64>(),
        any::<u32>(),
        proptest::option::of(
            (
                proptest::collection::vec(text(), 1..3),
                headers(),
                proptest::option::of(text()),
                proptest::option::of(text()),
                any::<u64>(),
                any::<u64>(),
            )
                .prop_map(|(command, env, cwd, readiness_path, startup, grace)| {
                    ProcessSpec {
                        command,
                        env,
                        pre_run: readiness_path.as_ref().map(|c| format!("setup {c}")),
                        cwd,
                        readiness_path,
                        startup_timeout_ms: startup,
                        stop_grace_ms: grace,
                    }
                }),
        ),
        (0u32..3, 0u32..3, policy()),
    )
        .prop_map(
            |(
                n,
                domains,
                dep,
                idle,
                min,
                max,
                hold,
                q,
                process,
                (concurrency, max_connecting, policy),
            )| {
                RouteSpec {
                    name: n,
                    domains: domains.into_iter().map(String::from).collect(),
                    deployment: dep,
                    idle_after_ms: idle,
                    min_replicas: min,
                    max_replicas: max,
                    hold_timeout_ms: hold,
                    hold_queue_max: q,
                    process,
                    concurrency,
                    max_connecting,
                    policy: Box::new(policy),
                    ..Default::default()
                }
            },
        )
}

fn policy() -> impl Strategy<Value = ebb::discovery::Policy> {
    use ebb::discovery::{Balancer, HashOn, Policy};
    (0usize..Balancer::ALL.len(), 1u32..5, 0u64..60_000).prop_map(|(b, choices, slow)| Policy {
        balancer: Balancer::ALL[b],
        choices,
        slow_start_ms: slow,
        hash_on: (Balancer::ALL[b] == Balancer::ConsistentHash)
            .then(|| HashOn::Header("x-user".into())),
        ..Policy::default()
    })
}

fn call_spec() -> impl Strategy<Value = CallSpec> {
    (
        name(),
        text(),
        prop_oneof![Just(CallKind::Sync), Just(CallKind::Async)],
        0u64..100_000,
        proptest::option::of(text()),
        (text(), text(), headers(), bytes()),
    )
        .prop_map(
            |(id, target, kind, timeout_ms, partition, (method, path, headers, body))| CallSpec {
                id,
                target,
                kind,
                timeout_ms,
                partition,
                trace: None,
                tracestate: None,
                baggage: None,
                payload: Payload {
                    method,
                    path,
                    headers,
                    body,
                },
            },
        )
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![Just(Outcome::Success), Just(Outcome::Error)]
}

fn template() -> impl Strategy<Value = TemplateSpec> {
    (
        name(),
        proptest::option::of(text()),
        text(),
        proptest::collection::vec(text(), 0..3),
        proptest::option::of(text()),
        (proptest::option::of(name()), proptest::option::of(name())),
        (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
        ),
        proptest::option::of(text()),
    )
        .prop_map(
            |(name, pre_run, function, command, service_address, (left, right), nums, schedule)| {
                TemplateSpec {
                    image: service_address.as_ref().map(|a| format!("registry/{a}")),
                    name,
                    pre_run,
                    function,
                    command,
                    service_address,
                    left,
                    right,
                    init_instances: nums.0,
                    min_instances: nums.1,
                    max_instances: nums.2,
                    timeout_ms: nums.3,
                    concurrency: nums.4,
                    schedule,
                    policy: Default::default(),
                    warm: Vec::new(),
                }
            },
        )
}

fn cleaner() -> impl Strategy<Value = CleanerSpec> {
    (
        name(),
        0u64..100_000,
        1u64..100_000,
        any::<bool>(),
        proptest::collection::vec(text(), 0..3),
        proptest::collection::vec(
            (name(), text(), any::<bool>(), any::<bool>()).prop_map(|(n, r, d, i)| CleanerTarget {
                name: n,
                reference: r,
                delete: d,
                include_when_evaluating: i,
            }),
            0..3,
        ),
    )
        .prop_map(
            |(name, ttl_ms, retry_period_ms, monotonic, conditions, targets)| CleanerSpec {
                name,
                ttl_ms,
                retry_period_ms,
                monotonic,
                conditions,
                targets,
                ..CleanerSpec::default()
            },
        )
}

/// The bounds a forgetting names (what it kept the ended calls or instances within).
fn kept() -> impl Strategy<Value = ebb::event::Kept> {
    (0u64..10, 0u64..100_000).prop_map(|(count, bytes)| ebb::event::Kept { count, bytes })
}

/// Every event variant, over a small id space so that events collide on the same objects.
fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        route_spec().prop_map(|route| Event::RouteUpserted {
            route: Box::new(route)
        }),
        name().prop_map(|name| Event::RouteRemoved { name }),
        (name(), 1u64..100, 0u64..1_000_000).prop_map(|(route, count, last_at_ms)| {
            Event::RequestsSeen {
                route,
                count,
                last_at_ms,
            }
        }),
        (
            name(),
            0u32..4,
            0u32..4,
            prop_oneof![
                Just(ScaleReason::Wake),
                Just(ScaleReason::Idle),
                Just(ScaleReason::Autoscale),
                Just(ScaleReason::Manual),
                Just(ScaleReason::Restart),
                Just(ScaleReason::Shutdown)
            ]
        )
            .prop_map(|(deployment, from, to, reason)| Event::ScaleRequested {
                deployment,
                from,
                to,
                reason
            }),
        (name(), 0u32..4).prop_map(|(deployment, replicas)| Event::ScaledUp {
            deployment,
            replicas
        }),
        (name(), 0u32..4).prop_map(|(deployment, replicas)| Event::ScaledDown {
            deployment,
            replicas
        }),
        (name(), 0u32..4, text()).prop_map(|(deployment, to, error)| Event::ScaleFailed {
            deployment,
            to,
            error
        }),
        call_spec().prop_map(|call| Event::CallQueued {
            call: std::sync::Arc::new(call)
        }),
        (name(), name(), 0u64..1_000_000).prop_map(|(id, runner, deadline_at_ms)| {
            Event::CallStarted {
                id,
                runner,
                deadline_at_ms,
            }
        }),
        (
            name(),
            name(),
            prop_oneof![
                Just(RejectReason::AlreadyRunning),
                Just(RejectReason::AlreadyFinal),
                Just(RejectReason::UnknownCall)
            ]
        )
            .prop_map(|(id, runner, reason)| Event::CallRejected { id, runner, reason }),
        (
            name(),
            name(),
            outcome(),
            proptest::option::of((any::<u16>(), headers(), bytes()).prop_map(
                |(status, headers, body)| CallResult {
                    status,
                    headers,
                    body
                }
            )),
            text()
        )
            .prop_map(|(id, runner, outcome, result, log)| Event::CallFinished {
                id,
                runner,
                outcome,
                result,
                log
            }),
        name().prop_map(|id| Event::CallTimedOut { id }),
        name().prop_map(|id| Event::CallCancelled { id }),
        (
            0u64..3_000,
            proptest::option::of(kept()),
            proptest::option::of((0u64..3_000, 0u64..20)),
        )
            .prop_map(|(finished_before_ms, within, keep_gone)| {
                Event::CallsForgotten {
                    finished_before_ms,
                    within,
                    keep_gone: keep_gone.map(|(ended_since_ms, most)| ebb::event::KeepGone {
                        ended_since_ms,
                        most,
                    }),
                }
            }),
        (0u64..3_000, proptest::option::of(kept())).prop_map(|(finished_before_ms, within)| {
            Event::InstancesForgotten {
                finished_before_ms,
                within,
            }
        }),
        template().prop_map(|template| Event::TemplateUpserted {
            template: Box::new(template)
        }),
        name().prop_map(|name| Event::TemplateDeleted { name }),
        (name(), name(), bytes()).prop_map(|(id, template, args)| Event::InstanceCreated {
            id,
            template,
            args
        }),
        (name(), name(), name()).prop_map(|(id, function, call_id)| Event::InstanceStepped {
            id,
            function,
            call_id
        }),
        (name(), outcome(), bytes()).prop_map(|(id, outcome, result)| Event::InstanceFinished {
            id,
            outcome,
            result
        }),
        (name(), 0u64..50, 0u64..100).prop_map(|(function, by, cap)| Event::CounterAdded {
            function,
            by,
            cap
        }),
        (name(), 0u64..50).prop_map(|(function, by)| Event::CounterDecayed { function, by }),
        cleaner().prop_map(|cleaner| Event::CleanerUpserted {
            cleaner: Box::new(cleaner)
        }),
        (name(), any::<bool>(), proptest::option::of(0u64..1_000_000)).prop_map(
            |(name, result, next_at_ms)| Event::CleanerEvaluated {
                name,
                result,
                next_at_ms,
                reason: String::new(),
                message: String::new(),
                results: vec![result],
                evaluations: 1,
                would_delete: Vec::new(),
                folded: 0,
            }
        ),
        name().prop_map(|name| Event::CleanerFired { name }),
        (name(), proptest::collection::vec(text(), 0..3))
            .prop_map(|(name, targets)| Event::CleanerFiring { name, targets }),
        name().prop_map(|name| Event::CleanerDeleted { name }),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn options(snapshot_every_events: u64) -> Options {
    Options {
        durability: Durability::Sync,
        snapshot_every_events,
        ..Options::default()
    }
}

/// Appends `events` in chunks of the given sizes, the clock moving between chunks; returns the
/// live state.
fn append_chunks(log: &Log, clock: &SimClock, events: &[Event], chunks: &[usize]) -> State {
    let rt = runtime();
    let mut rest = events;
    let mut sizes = chunks.iter().cycle();
    while !rest.is_empty() {
        let n = (*sizes.next().unwrap()).clamp(1, rest.len());
        let (now, later) = rest.split_at(n);
        rt.block_on(log.append_all(now.to_vec())).unwrap();
        clock.advance(n as u64 * 7);
        rest = later;
    }
    log.read(|s| s.clone())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn codec_round_trips_every_event(ev in event(), seq in 1u64.., at_ms in any::<u64>()) {
        let env = Envelope { seq, at_ms, version: SCHEMA_VERSION, event: ev };
        prop_assert_eq!(decode(&encode(&env)).unwrap(), env);
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn replay_from_scratch_and_from_any_snapshot_equals_live(
        events in proptest::collection::vec(event(), 1..120),
        chunks in proptest::collection::vec(1usize..9, 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let store = Arc::new(MemStore::new());
        let clock = SimClock::new(1_000);
        let log: Log = Log::open(store.clone(), options(0), Arc::new(clock.clone()), &mut |_| {}).unwrap();
        let live = append_chunks(&log, &clock, &events, &chunks);
        log.close();
        prop_assert_eq!(live.seq, events.len() as u64);

        let (scratch, snap) = open_state::<State>(store.as_ref(), None, &mut |_| {}).unwrap();
        prop_assert_eq!(snap, 0);
        prop_assert_eq!(&scratch, &live);

        // A snapshot at any point, encoded and decoded, plus the tail after it.
        let k = cut.index(events.len() + 1) as u64;
        let (at_k, _) = open_state::<State>(store.as_ref(), Some(k), &mut |_| {}).unwrap();
        prop_assert_eq!(at_k.seq, k);
        let mut resumed = State::decode_snapshot(&at_k.encode_snapshot()).unwrap();
        prop_assert_eq!(&resumed, &at_k);
        replay_range(store.as_ref(), &mut resumed, live.seq, &mut |_| {}).unwrap();
        prop_assert_eq!(&resumed, &live);

        // The same through a stored snapshot and a reopened log.
        store.put_snapshot(k, &at_k.encode_snapshot()).unwrap();
        let reopened: Log = Log::open(store.clone(), options(0), Arc::new(clock.clone()), &mut |_| {}).unwrap();
        prop_assert_eq!(&*reopened.state(), &live);
    }

    #[test]
    fn the_call_state_machine_never_leaves_a_final_state_nor_runs_twice(
        events in proptest::collection::vec(event(), 1..200),
    ) {
        let mut state = State::default();
        for (i, ev) in events.into_iter().enumerate() {
            let before: BTreeMap<String, (CallStatus, u32)> = state
                .calls
                .by_id
                .iter()
                .map(|(k, c)| (k.to_string(), (c.status, c.starts)))
                .collect();
            state.apply(&Envelope { seq: i as u64 + 1, at_ms: i as u64, version: SCHEMA_VERSION, event: ev });
            for (id, c) in &state.calls.by_id {
                prop_assert!(c.starts <= 1, "call {} started {} times", id, c.starts);
                if let Some((old, _)) = before.get(id.as_str())
                    && old.is_final()
                {
                    prop_assert_eq!(c.status, *old, "call {} left final state", id);
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Command {
    Queue(String, u64),
    Start(String, String),
    Finish(String, Outcome),
    Tick(u64),
}

fn command() -> impl Strategy<Value = Command> {
    prop_oneof![
        (name(), 1u64..50).prop_map(|(id, t)| Command::Queue(id, t)),
        (name(), name()).prop_map(|(id, r)| Command::Start(id, r)),
        (name(), outcome()).prop_map(|(id, o)| Command::Finish(id, o)),
        (1u64..40).prop_map(Command::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Runners issuing start/finish in any order, through the real decisions and the real writer:
    /// at most one start per call is ever accepted, finishes after the first change nothing, and
    /// the live state equals the replayed log.
    #[test]
    fn decisions_through_the_writer_start_each_call_at_most_once(
        commands in proptest::collection::vec(command(), 1..150),
    ) {
        let store = Arc::new(MemStore::new());
        let clock = SimClock::new(0);
        let log: Log = Log::open(store.clone(), options(16), Arc::new(clock.clone()), &mut |_| {}).unwrap();
        let rt = runtime();
        let mut accepted: BTreeMap<String, u32> = BTreeMap::new();
        let mut first_finish: BTreeMap<String, CallStatus> = BTreeMap::new();
        for cmd in commands {
            match cmd {
                Command::Queue(id, timeout_ms) => {
                    let exists = log.read(|s| s.calls.get(&id).is_some());
                    if !exists {
                        rt.block_on(log.append(Event::CallQueued { call: std::sync::Arc::new(CallSpec {
                            id, target: "t".into(), kind: CallKind::Async, timeout_ms,
                            partition: None, payload: Payload::default(), trace: None, tracestate: None, baggage: None,
                        })})).unwrap();
                    }
                }
                Command::Start(id, runner) => {
                    let key = id.clone();
                    let (verdict, _) = rt.block_on(log.decide(move |s: &State, now| {
                        let (ev, verdict) = decide_start(&s.calls, &id, &runner, now);
                        (vec![ev], verdict)
                    })).unwrap();
                    if verdict == StartVerdict::Accepted {
                        *accepted.entry(key).or_default() += 1;
                    }
                }
                Command::Finish(id, outcome) => {
                    let key = id.clone();
                    rt.block_on(log.decide(move |s: &State, _| {
                        (decide_finish(&s.calls, id, "r", outcome, None, String::new())
                            .into_iter().collect(), ())
                    })).unwrap();
                    let status = log.read(|s| s.calls.get(&key).unwrap().status);
                    prop_assert!(status.is_final());
                    let first = *first_finish.entry(key).or_insert(status);
                    prop_assert_eq!(status, first, "a repeated finish changed the outcome");
                }
                Command::Tick(ms) => {
                    clock.advance(ms);
                    rt.block_on(log.decide(|s: &State, now| {
                        let due: Vec<&str> = s.schedule.due(now).filter_map(|(_, d)| match d {
                            ebb::state::Due::CallTimeout(id) => Some(id.as_str()),
                            _ => None,
                        }).collect();
                        (decide_timeouts(&s.calls, &due, now), ())
                    })).unwrap();
                }
            }
        }
        for (id, n) in &accepted {
            prop_assert!(*n <= 1, "call {} was started {} times", id, n);
        }
        let live = log.read(|s| s.clone());
        for (id, c) in &live.calls.by_id {
            prop_assert_eq!(c.starts, accepted.get(id.as_str()).copied().unwrap_or(0));
        }
        log.close();
        let (replayed, _) = open_state::<State>(store.as_ref(), None, &mut |_| {}).unwrap();
        prop_assert_eq!(replayed, live);
    }
}

/// The same replay equivalence on RocksDB on disk, with automatic snapshots along the way.
#[test]
fn replay_on_rocksdb_with_automatic_snapshots_equals_live() {
    let dir = tempfile::tempdir().unwrap();
    let clock = SimClock::new(1_700_000_000_000);
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let events: Vec<Event> = (0..2_000)
        .map(|_| event().new_tree(&mut runner).unwrap().current())
        .collect();
    let store = Arc::new(RocksStore::open(dir.path(), OpenMode::Create).unwrap());
    let log: Log = Log::open(
        store.clone(),
        options(300),
        Arc::new(clock.clone()),
        &mut |_| {},
    )
    .unwrap();
    let live = append_chunks(&log, &clock, &events, &[1, 7, 64, 3, 250]);
    log.close();
    let snaps = store.snapshot_seqs().unwrap();
    assert!(
        snaps.len() >= 5,
        "expected automatic snapshots, got {snaps:?}"
    );
    let (from_snap, used) = open_state::<State>(store.as_ref(), None, &mut |_| {}).unwrap();
    assert_eq!(used, *snaps.last().unwrap());
    assert_eq!(from_snap, live);
    let mut scratch = State::default();
    replay_range(store.as_ref(), &mut scratch, live.seq, &mut |_| {}).unwrap();
    assert_eq!(scratch, live);
    for &s in &snaps {
        let snap = State::decode_snapshot(&store.get_snapshot(s).unwrap().unwrap()).unwrap();
        let (at_s, _) = open_state::<State>(store.as_ref(), Some(s), &mut |_| {}).unwrap();
        assert_eq!(snap.seq, s);
        assert_eq!(snap, at_s);
    }
    drop(store);
    let store = Arc::new(RocksStore::open(dir.path(), OpenMode::Existing).unwrap());
    let reopened: Log = Log::open(store, options(0), Arc::new(clock), &mut |_| {}).unwrap();
    assert_eq!(&*reopened.state(), &live);
}
