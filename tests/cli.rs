//! The command line against real logs on disk: stats, dump, tail, replay, explain, snapshot,
//! compact, serve, and clear one-line errors for bad input.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use ebb::clock::SimClock;
use ebb::event::{
    CallKind, CallSpec, Event, Outcome, Payload, RouteSpec, SCHEMA_VERSION, ScaleReason, encode,
};
use ebb::log::rocks::OpenMode;
use ebb::log::{Durability, Log, LogStore, Options, RecordBatch, RocksStore};

const T0: u64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z

fn command(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ebb"));
    c.args(args)
        .arg("--data-dir")
        .arg(dir)
        .env("EBB_LOG", "warn");
    c
}

/// Runs ebb to completion.
fn ebb(dir: &Path, args: &[&str]) -> Output {
    command(dir, args).output().unwrap()
}

/// Starts ebb with its stdout piped; it is killed when dropped.
fn spawn(dir: &Path, args: &[&str]) -> KillOnDrop {
    KillOnDrop(
        command(dir, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    )
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "command failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Asserts a one-line error containing `needle` and a non-zero exit.
fn fails(out: &Output, needle: &str) {
    assert!(!out.status.success(), "expected failure, got success");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(needle), "stderr {err:?} lacks {needle:?}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "error is one line: {err:?}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

fn route() -> RouteSpec {
    RouteSpec {
        name: "demo".into(),
        domains: vec!["demo.localhost".into()],
        deployment: "demo-app".into(),
        idle_after_ms: 60_000,
        min_replicas: 0,
        max_replicas: 2,
        hold_timeout_ms: 30_000,
        hold_queue_max: 100,
        process: None,
        concurrency: 0,
        max_connecting: 0,
        policy: Default::default(),
        ..Default::default()
    }
}

/// Writes a small known history, one event per second from T0.
fn write_history(dir: &Path) -> Vec<Event> {
    let events = vec![
        Event::RouteUpserted {
            route: Box::new(route()),
        },
        Event::ScaleRequested {
            deployment: "demo-app".into(),
            from: 0,
            to: 1,
            reason: ScaleReason::Wake,
        },
        Event::ScaledUp {
            deployment: "demo-app".into(),
            replicas: 1,
        },
        Event::RequestsSeen {
            route: "demo".into(),
            count: 12,
            last_at_ms: T0 + 3_000,
        },
        Event::CallQueued {
            call: std::sync::Arc::new(CallSpec {
                id: "call-1".into(),
                target: "demo".into(),
                kind: CallKind::Async,
                timeout_ms: 10_000,
                partition: None,
                trace: None,
                tracestate: None,
                baggage: None,
                payload: Payload::default(),
            }),
        },
        Event::CallStarted {
            id: "call-1".into(),
            runner: "r1".into(),
            deadline_at_ms: T0 + 15_000,
        },
        Event::CallFinished {
            id: "call-1".into(),
            runner: "r1".into(),
            outcome: Outcome::Success,
            result: None,
            log: "done".into(),
        },
        Event::ScaledDown {
            deployment: "demo-app".into(),
            replicas: 0,
        },
    ];
    let clock = SimClock::new(T0);
    let store = Arc::new(RocksStore::open(dir, OpenMode::Create).unwrap());
    let log: Log = Log::open(
        store,
        Options {
            durability: Durability::Sync,
            snapshot_every_events: 0,
            ..Options::default()
        },
        Arc::new(clock.clone()),
        &mut |_| {},
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for e in &events {
        rt.block_on(log.append(e.clone())).unwrap();
        clock.advance(1_000);
    }
    log.close();
    events
}

fn overwrite(dir: &Path, seq: u64, value: &[u8]) {
    let store = RocksStore::open(dir, OpenMode::Existing).unwrap();
    let mut b = RecordBatch::default();
    b.push(seq, value);
    store.write(&b, true).unwrap();
}

#[test]
fn stats_dump_replay_and_explain_read_the_history() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let events = write_history(&dir);

    let stats = ok(&ebb(&dir, &["log", "stats"]));
    assert!(stats.contains("1..=8 (8 events"), "{stats}");
    assert!(stats.contains("CallFinished") && stats.contains("2026-01-01T00:00:00.000Z"));

    let dump = ok(&ebb(&dir, &["log", "dump", "--json"]));
    let lines: Vec<serde_json::Value> = dump
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), events.len());
    assert_eq!(lines[3]["seq"], 4);
    assert_eq!(lines[3]["event"]["RequestsSeen"]["count"], 12);
    let part = ok(&ebb(&dir, &["log", "dump", "--from", "2", "--to", "3"]));
    assert_eq!(part.lines().count(), 2);
    assert!(part.contains("ScaleRequested") && part.contains("ScaledUp"));

    let at3: serde_json::Value =
        serde_json::from_str(&ok(&ebb(&dir, &["replay", "--until", "3", "--json"]))).unwrap();
    assert_eq!(at3["seq"], 3);
    assert_eq!(at3["routes"]["deployments"]["demo-app"]["replicas"], 1);
    assert!(at3["calls"]["by_id"].as_object().unwrap().is_empty());

    // Readable: each route with its replicas, and the last decision about them and why.
    let at3_text = ok(&ebb(&dir, &["replay", "--until", "3"]));
    assert!(
        at3_text.contains("asked for 1 at 2026-01-01T00:00:01.000Z (wake)"),
        "{at3_text}"
    );
    // By time: events are one second apart from T0, so 00:00:05.5 includes seqs 1..=6.
    let at_time: serde_json::Value = serde_json::from_str(&ok(&ebb(
        &dir,
        &["replay", "--at", "2026-01-01T00:00:05.500Z", "--json"],
    )))
    .unwrap();
    assert_eq!(at_time["seq"], 6);
    assert_eq!(at_time["calls"]["by_id"]["call-1"]["status"], "running");

    let end = ok(&ebb(&dir, &["replay"]));
    assert!(end.contains("state at seq 8"), "{end}");
    assert!(
        end.contains("demo.localhost -> demo-app (replicas 0"),
        "{end}"
    );

    let route = ok(&ebb(&dir, &["explain", "route", "demo"]));
    for name in [
        "RouteUpserted",
        "ScaleRequested",
        "ScaledUp",
        "RequestsSeen",
        "ScaledDown",
    ] {
        assert!(route.contains(name), "explain route lacks {name}: {route}");
    }
    assert!(!route.contains("CallQueued"));
    // Told in words, a line per event, from what ebb knew then.
    for line in [
        "route demo: 5 events (times in UTC)",
        "2026-01-01",
        "  00:00:01.000  #2      ScaleRequested   scale demo-app from 0 to 1: a request came while no replica was ready",
        "  00:00:02.000  #3      ScaledUp         demo-app has 1 replica ready, 1 s after it was asked",
        "  00:00:03.000  #4      RequestsSeen     12 requests to demo, the last at 00:00:03",
    ] {
        assert!(
            route.lines().any(|l| l == line),
            "{line:?} not in:\n{route}"
        );
    }
    let call = ok(&ebb(&dir, &["explain", "call", "call-1"]));
    assert!(
        call.contains("runner r1 started it after 1 s in the queue; it must finish by 00:00:15"),
        "{call}"
    );
    let call: serde_json::Value =
        serde_json::from_str(&ok(&ebb(&dir, &["explain", "call", "call-1", "--json"]))).unwrap();
    assert_eq!(call["events"].as_array().unwrap().len(), 3);
    assert_eq!(call["current"]["status"], "success");
    assert_eq!(call["current"]["log"], "done");
}

#[test]
fn bad_input_gets_one_clear_line_and_a_non_zero_exit() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    write_history(&dir);

    fails(
        &ebb(&dir, &["replay", "--until", "99"]),
        "seq 99 is past the end",
    );
    fails(&ebb(&dir, &["explain", "call", "nope"]), "no call \"nope\"");
    fails(
        &ebb(&dir, &["explain", "route", "nope"]),
        "no route \"nope\"",
    );
    fails(
        &ebb(&dir, &["replay", "--at", "yesterday"]),
        "not an RFC 3339 time",
    );
    fails(&ebb(&dir, &["log", "dump", "--from", "50"]), "past the end");

    let missing = tmp.path().join("missing");
    fails(&ebb(&missing, &["log", "stats"]), "does not exist");
    let not_log = tmp.path().join("not-a-log");
    std::fs::create_dir(&not_log).unwrap();
    std::fs::write(not_log.join("hello.txt"), "hi").unwrap();
    fails(&ebb(&not_log, &["replay"]), "is not an ebb log");
    fails(
        &ebb(&not_log, &["serve", "--listen", "127.0.0.1:0"]),
        "is not an ebb log",
    );
    // Image functions where this ebb would not see their endpoints.
    fails(
        &ebb(
            &tmp.path().join("fresh"),
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--orchestrator",
                "kubernetes",
                "--namespace",
                "apps",
                "--functions-namespace",
                "fns",
            ],
        ),
        "watches \"apps\" only",
    );

    // A truncated record names its seq, in every tool that reads it.
    let good = encode(&ebb::event::Envelope {
        seq: 5,
        at_ms: T0,
        version: SCHEMA_VERSION,
        event: Event::RouteRemoved { name: "x".into() },
    });
    overwrite(&dir, 5, &good[..good.len() - 2]);
    fails(&ebb(&dir, &["log", "dump"]), "record at seq 5");
    fails(&ebb(&dir, &["replay"]), "record at seq 5");
    // explain reads an object's own records (through the subject index): the call whose record
    // it is fails on it, the route, whose records are whole, is told.
    fails(
        &ebb(&dir, &["explain", "call", "call-1"]),
        "record at seq 5",
    );
    ok(&ebb(&dir, &["explain", "route", "demo"]));
    // Replay up to just before it still works.
    ok(&ebb(&dir, &["replay", "--until", "4"]));

    overwrite(&dir, 5, b"\xffgarbage");
    fails(&ebb(&dir, &["log", "stats"]), "record at seq 5");

    // A record from a newer ebb.
    let mut newer = Vec::new();
    rmp::encode::write_array_len(&mut newer, 4).unwrap();
    rmp::encode::write_uint(&mut newer, u64::from(SCHEMA_VERSION) + 1).unwrap();
    rmp::encode::write_uint(&mut newer, 5).unwrap();
    rmp::encode::write_uint(&mut newer, T0).unwrap();
    newer.push(0xc0);
    overwrite(&dir, 5, &newer);
    fails(&ebb(&dir, &["replay"]), "newer than this ebb understands");

    // A misplaced record (an envelope stored under another seq).
    let moved = encode(&ebb::event::Envelope {
        seq: 2,
        at_ms: T0,
        version: SCHEMA_VERSION,
        event: Event::RouteRemoved { name: "x".into() },
    });
    overwrite(&dir, 5, &moved);
    fails(&ebb(&dir, &["log", "dump"]), "envelope says seq 2");
}

#[test]
fn snapshot_and_compact_keep_the_state_and_drop_old_events() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    write_history(&dir);
    let before = ok(&ebb(&dir, &["replay", "--json"]));
    fails(&ebb(&dir, &["log", "compact"]), "no snapshot to compact to");
    assert!(ok(&ebb(&dir, &["log", "snapshot"])).contains("snapshot taken at seq 8"));
    assert!(ok(&ebb(&dir, &["log", "compact"])).contains("deleted 7 events before seq 8"));
    assert_eq!(ok(&ebb(&dir, &["replay", "--json"])), before);
    fails(&ebb(&dir, &["replay", "--until", "3"]), "compacted away");
    // The route's events are gone but the route stands: explain says so.
    let story = ok(&ebb(&dir, &["explain", "route", "demo"]));
    assert!(
        story.contains("route demo: 0 events")
            && story.contains("events up to seq 8 are only in its snapshot"),
        "{story}"
    );
    let stats = ok(&ebb(&dir, &["log", "stats"]));
    assert!(stats.contains("8..=8 (1 events"), "{stats}");
}

/// Reads lines from a child's stdout on a thread, so the test can wait with a deadline.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `ebb debug append-stress` with `args` to its end.
fn appended(dir: &Path, args: &[&str]) {
    let mut all = vec!["debug", "append-stress"];
    all.extend_from_slice(args);
    ok(&ebb(dir, &all));
}

#[test]
fn tail_follows_another_process_appending() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    appended(&dir, &["--appenders", "4", "--count", "10"]);
    let scratch = tmp.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let mut tail = KillOnDrop(
        command(
            &dir,
            &["log", "tail", "--json", "--from", "1", "--poll-ms", "20"],
        )
        .env("TMPDIR", &scratch)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap(),
    );
    let rx = lines_of(&mut tail.0);
    let next_seq = |rx: &mpsc::Receiver<String>| -> u64 {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("tail printed nothing in time");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        v["seq"].as_u64().unwrap()
    };
    for want in 1..=10 {
        assert_eq!(next_seq(&rx), want);
    }
    appended(&dir, &["--appenders", "4", "--count", "25"]);
    for want in 11..=35 {
        assert_eq!(next_seq(&rx), want);
    }
    // The writer flushing its memtables while the tail follows (moving to new WALs and deleting
    // the flushed ones, as it does every 64 MiB): every event still comes, once, in order.
    appended(
        &dir,
        &[
            "--appenders",
            "8",
            "--count",
            "20000",
            "--flush-every",
            "200",
        ],
    );
    for want in 36..=20_035 {
        assert_eq!(next_seq(&rx), want);
    }
    // SIGTERM ends it cleanly, its scratch directory gone.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(tail.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(tail.0.wait().unwrap().success());
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
}

#[test]
fn serve_answers_healthz_and_unknown_paths_with_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let mut serve = spawn(
        &dir,
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
    );
    let rx = lines_of(&mut serve.0);
    let next_addr = |what: &str| -> String {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("serve did not start");
        line.strip_prefix(&format!("ebb {what} listening on http://"))
            .unwrap_or_else(|| panic!("unexpected line {line:?}"))
            .to_owned()
    };
    let _proxy = next_addr("proxy");
    let addr = next_addr("admin");
    let get = |path: &str| -> String {
        let mut s = TcpStream::connect(&addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    };
    let health = get("/healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.contains(r#""status":"ok""#), "{health}");
    let ready = get("/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    // Each check with its reason.
    let checks: serde_json::Value =
        serde_json::from_str(ready.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    for check in ["log", "projection", "orchestrator"] {
        assert_eq!(checks["checks"][check]["ok"], true, "{check}: {ready}");
    }
    assert_eq!(checks["checks"]["log"]["reason"], "open");
    // The calls API's readiness adds the queue's.
    let calls = get("/readyz/calls");
    assert!(calls.starts_with("HTTP/1.1 200"), "{calls}");
    let checks: serde_json::Value =
        serde_json::from_str(calls.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    for check in ["log", "projection", "orchestrator", "queue"] {
        assert_eq!(checks["checks"][check]["ok"], true, "{check}: {calls}");
    }
    let missing = get("/nope");
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    assert!(missing.contains(r#""code":"not_found""#), "{missing}");
    // The data dir is now an ebb log that the read tools accept, while serve still runs.
    // Its one event: the retention, a standing cleaner, recorded at the first start.
    let stats = ok(&ebb(&dir, &["log", "stats"]));
    assert!(stats.contains("(1 events"), "{stats}");
    assert!(stats.contains("CleanerUpserted    1"), "{stats}");
}

/// `deploy/` and `schema/` hold the custom resource definitions `ebb crds` generates from ebb's
/// types, as they are now: a type changed without `ebb crds --out deploy/chart/crds` (and
/// `schema/crds`) fails here.
#[test]
fn deploy_holds_the_crds_ebb_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("crds");
    std::fs::create_dir(&out).unwrap();
    ok(&ebb(
        &tmp.path().join("data"),
        &["crds", "--out", out.to_str().unwrap()],
    ));
    let deployed = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/chart/crds");
    let names = |dir: &Path| -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".json"))
            .collect();
        n.sort();
        n
    };
    // deploy/ applies them; schema/ documents them, with the events.
    for kept_in in ["deploy/chart/crds", "schema/crds"] {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(kept_in);
        assert_eq!(
            names(&out),
            names(&dir),
            "{kept_in} is stale: run `ebb crds --out {kept_in}`"
        );
        for name in names(&out) {
            let now = std::fs::read_to_string(out.join(&name)).unwrap();
            let kept = std::fs::read_to_string(dir.join(&name)).unwrap();
            assert!(
                now == kept,
                "{kept_in}/{name} is stale: run `ebb crds --out {kept_in}`"
            );
        }
    }
    assert!(!names(&out).is_empty());
    // Every definition is listed in the kustomization.
    let k = std::fs::read_to_string(deployed.join("kustomization.yaml")).unwrap();
    for name in names(&out) {
        assert!(
            k.contains(&format!("- {name}")),
            "{name} is not in deploy/chart/crds/kustomization.yaml"
        );
    }
    // On stdout too, the same definitions.
    let all = ok(&ebb(&tmp.path().join("data"), &["crds"]));
    assert!(all.contains("\"name\": \"functions.ebb.dev\""), "{all}");
    assert!(
        all.contains("\"name\": \"cleaners.cleaner.ebb.dev\""),
        "{all}"
    );
}
