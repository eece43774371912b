//! TCP routes with a real server from Debian: `redis-server` behind ebb, woken from zero by
//! `redis-cli PING`, stopped when idle, no command lost across its stops; 50 concurrent cold
//! connections make one spawn and all get their answer; an open connection keeps it awake.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common;

use common::controlplane::wait_until;

const LIMIT: Duration = Duration::from_secs(60);

fn redis_app(name: &str, port: u16, idle_after_ms: u64) -> String {
    format!(
        "[[app]]\nname = \"{name}\"\ndomains = []\nlisten = \"127.0.0.1:{port}\"\ncommand = [\"sh\", \"-c\", \"exec redis-server --port $PORT --bind 127.0.0.1 --save '' --appendonly no\"]\nidle_after_ms = {idle_after_ms}\nstop_grace_ms = 2000\nhold_timeout_ms = 30000\n"
    )
}

fn config(dir: &Path, apps: &str) -> PathBuf {
    let path = dir.join("ebb.toml");
    std::fs::write(&path, apps).unwrap();
    path
}

/// `redis-cli -p PORT ARGS...`, its output trimmed (an error answer fails the test).
fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs (./scripts/test installs Debian's redis-server and redis-tools)");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        out.status.success()
            && !text.starts_with("Could not connect")
            && !text.starts_with("Error"),
        "redis-cli {args:?}: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// One inline `PING` on a connection of its own; the answer.
async fn ping(port: u16) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(b"PING\r\n").await.unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 64];
    while !got.ends_with(b"\r\n") {
        let n = tokio::time::timeout(LIMIT, s.read(&mut chunk))
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(n > 0, "closed before answering: {got:?}");
        got.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Through the relay threads (io_uring, the default), whose start ebb's log says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_wakes_on_ping_goes_idle_and_loses_no_command_across_its_stops() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ebb.log");
    let (ebb, port) = wakes_idles_and_loses_nothing(dir.path(), &[], Some(&log)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("TCP routes relay through io_uring"),
        "the relay served the route: {text}"
    );
    // An open connection is on the relay (/metrics), and leaves it when it closes.
    let gauge = "ebb_tcp_relay_connections";
    let mut held = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    held.write_all(b"PING\r\n").await.unwrap();
    let mut got = [0u8; 7];
    held.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"+PONG\r\n");
    assert_eq!(metric(ebb.admin, gauge).await, 1);
    drop(held);
    wait_until("the closed connection left the relay", LIMIT, || async {
        (metric(ebb.admin, gauge).await == 0).then_some(())
    })
    .await;
    let dry = r#"ebb_tcp_relay_dry_receives_total{then="heap_buffer"}"#;
    assert_eq!(metric(ebb.admin, dry).await, 0, "the ring never ran dry");
}

/// A sample of ebb's `/metrics`.
async fn metric(admin: std::net::SocketAddr, name: &str) -> u64 {
    common::http::sample(&common::http::client(), admin, name).await
}

/// Through the proxy threads' copy loop (`--tcp-relay-threads 0`, and where io_uring cannot be
/// had).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copy_loop_wakes_goes_idle_and_loses_no_command_too() {
    let dir = tempfile::tempdir().unwrap();
    let (ebb, _) =
        wakes_idles_and_loses_nothing(dir.path(), &["--tcp-relay-threads", "0"], None).await;
    assert_eq!(metric(ebb.admin, "ebb_tcp_relay_connections").await, 0);
}

/// The route's ebb and port, after it woke, went idle and woke again under commands.
async fn wakes_idles_and_loses_nothing(
    dir: &Path,
    extra: &[&str],
    log: Option<&Path>,
) -> (common::Ebb, u16) {
    let data = dir.join("data");
    let port = common::free_port();
    let cfg = config(dir, &redis_app("redis", port, 300));
    // Its log, when kept, at info: the relay's start is said there.
    let info: &[(&str, &std::ffi::OsStr)] = &[("EBB_LOG", "info".as_ref())];
    let env = if log.is_some() { info } else { &[] };
    let ebb = common::serve_logged(&data, Some(&cfg), None, extra, env, log);

    // From zero: the first PING wakes it.
    assert_eq!(redis_cli(port, &["PING"]), "PONG");
    assert_eq!(common::scale_events(&data, "redis", "wake"), 1);
    wait_until("redis is stopped when idle", LIMIT, || async {
        (common::scale_events(&data, "redis", "idle") >= 1).then_some(())
    })
    .await;
    // Commands at moments around the idle stops: each is answered, by a replica woken again when
    // it meets one stopping or stopped.
    let mut tick = tokio::time::interval(Duration::from_millis(170));
    for i in 0..24 {
        tick.tick().await;
        let key = format!("k{i}");
        assert_eq!(redis_cli(port, &["SET", &key, "v"]), "OK", "command {i}");
        assert_eq!(redis_cli(port, &["PING"]), "PONG", "command {i}");
    }
    let wakes = common::scale_events(&data, "redis", "wake");
    assert!(wakes >= 2, "it went idle and woke again: {wakes} wakes");
    let story = common::ebb_ok(&data, &["explain", "route", "redis"]);
    assert!(story.contains(&format!("TCP 127.0.0.1:{port}")), "{story}");
    (ebb, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_cold_connections_spawn_once_and_an_open_one_keeps_it_awake() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let port = common::free_port();
    let cfg = config(dir.path(), &redis_app("burst", port, 400));
    let _ebb = common::serve(&data, Some(&cfg), None);

    let tasks: Vec<_> = (0..50).map(|_| tokio::spawn(ping(port))).collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), "+PONG\r\n");
    }
    assert_eq!(
        common::scale_events(&data, "burst", "wake"),
        1,
        "one spawn for the burst"
    );
    let spawned = std::fs::read_dir(data.join("workloads").join("burst"))
        .unwrap()
        .count();
    assert_eq!(spawned, 1);

    // An open connection is in flight: three idle periods pass under it without a stop.
    let mut held = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut tick = tokio::time::interval(Duration::from_millis(400));
    tick.tick().await;
    for _ in 0..3 {
        tick.tick().await;
    }
    assert_eq!(
        common::scale_events(&data, "burst", "idle"),
        0,
        "stopped under an open connection"
    );
    held.write_all(b"PING\r\n").await.unwrap();
    let mut got = [0u8; 7];
    held.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"+PONG\r\n");
    drop(held);
    // Closed: idle from its end.
    wait_until(
        "redis is stopped once the connection closed",
        LIMIT,
        || async { (common::scale_events(&data, "burst", "idle") == 1).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_routes_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    for (apps, want) in [
        (
            redis_app("a", port, 1000).replace(&format!("127.0.0.1:{port}"), "localhost"),
            "is not an IP:port address",
        ),
        (
            format!(
                "{}{}",
                redis_app("a", port, 1000),
                redis_app("b", port, 1000)
            ),
            "belongs to both",
        ),
        (
            redis_app("a", port, 1000).replace(&format!("listen = \"127.0.0.1:{port}\"\n"), ""),
            "no domains",
        ),
    ] {
        let cfg = config(dir.path(), &apps);
        let err = common::serve_refused(
            &dir.path().join("data"),
            ["--config".as_ref(), cfg.as_os_str()],
        );
        assert!(err.contains(want), "{err}");
    }
    // A port another process holds stops the start with the reason.
    let refused_on = |port: u16, data: &str| {
        let cfg = config(dir.path(), &redis_app("a", port, 1000));
        let err = common::serve_refused(
            &dir.path().join(data),
            ["--config".as_ref(), cfg.as_os_str()],
        );
        assert!(
            err.contains(&format!("TCP route a: listening on 127.0.0.1:{port}")),
            "{err}"
        );
    };
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    refused_on(taken.local_addr().unwrap().port(), "data2");
    // So does a port another ebb's proxy holds: its listeners take the port with
    // `SO_REUSEPORT`, and a second `SO_REUSEPORT` bind of the same user would share it, the
    // kernel splitting its connections between an HTTP proxy and this route.
    let other = common::serve(&dir.path().join("other"), None, None);
    refused_on(other.proxy.port(), "data3");
}
