//! Per-route timeouts through the real proxy, on both of its paths: a replica that does not begin
//! its answer (504 `response_timeout`), a request that moves no byte (504
//! `stream_idle_timeout`), a wake longer than the hold (503 `wake_timeout`), a keep-alive
//! connection and a WebSocket left idle (closed); each counted in `ebb_proxy_timeouts_total`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::common;

const LIMIT: Duration = Duration::from_secs(60);

fn config(dir: &Path) -> PathBuf {
    let app = |name: &str, args: &str, extra: &str| {
        format!(
            "[[app]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\ncommand = [\"ebb\", \"example-app\"{args}]\nstop_grace_ms = 1000\n{extra}\n"
        )
    };
    let text = [
        app("slow", "", "response_timeout_ms = 300"),
        app("quiet", "", "stream_idle_timeout_ms = 300"),
        app(
            "late",
            ", \"--startup-delay-ms\", \"20000\"",
            "hold_timeout_ms = 300",
        ),
        app("brief", "", "connection_idle_timeout_ms = 300"),
    ]
    .concat();
    let path = dir.join("ebb.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// One request on a connection of its own, read to the connection's end; the head and body.
async fn exchange(proxy: std::net::SocketAddr, raw: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(raw.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(LIMIT, s.read_to_end(&mut got))
        .await
        .expect("the proxy answers and closes in time")
        .unwrap();
    String::from_utf8_lossy(&got).into_owned()
}

fn code_of(answer: &str) -> String {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(body.trim())
        .unwrap_or_else(|e| panic!("not a JSON answer ({e}): {answer}"));
    v["code"].as_str().unwrap_or_default().to_owned()
}

async fn timeouts(admin: std::net::SocketAddr, route: &str, kind: &str) -> u64 {
    let c = common::http::client();
    let m = common::http::send(&c, admin, "GET", "localhost", "/metrics", &[]).await;
    let want = format!("ebb_proxy_timeouts_total{{route=\"{route}\",kind=\"{kind}\"}} ");
    m.body
        .lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .map_or(0, |n| n.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_timeout_answers_in_json_or_closes_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve(&dir.path().join("data"), Some(&config(dir.path())), None);

    // A replica slower to answer than the route's response timeout: 504 on both paths (HTTP/1.1
    // on the proxy's own path, HTTP/1.0 on hyper's).
    for version in ["HTTP/1.1", "HTTP/1.0"] {
        let a = exchange(
            ebb.proxy,
            &format!(
                "GET /sleep?ms=5000 {version}\r\nHost: slow.localhost\r\nConnection: close\r\n\r\n"
            ),
        )
        .await;
        assert!(a.contains(" 504 "), "{version}: {a}");
        assert_eq!(code_of(&a), "response_timeout", "{version}");
    }
    // A fast answer on the same route is not cut.
    let ok = exchange(
        ebb.proxy,
        "GET /pid HTTP/1.1\r\nHost: slow.localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert_eq!(timeouts(ebb.admin, "slow", "response").await, 2);

    // A request that moves no byte either way for the route's stream idle bound.
    let a = exchange(
        ebb.proxy,
        "GET /sleep?ms=5000 HTTP/1.1\r\nHost: quiet.localhost\r\n\r\n",
    )
    .await;
    assert!(a.contains(" 504 "), "{a}");
    assert_eq!(code_of(&a), "stream_idle_timeout");
    assert_eq!(timeouts(ebb.admin, "quiet", "stream_idle").await, 1);

    // A wake longer than the hold: 503, with Retry-After.
    let a = exchange(
        ebb.proxy,
        "GET /pid HTTP/1.1\r\nHost: late.localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        a.contains(" 503 ") && a.to_ascii_lowercase().contains("retry-after"),
        "{a}"
    );
    assert_eq!(code_of(&a), "wake_timeout");
    assert_eq!(timeouts(ebb.admin, "late", "hold").await, 1);

    // A keep-alive connection left idle after a request of a route with a short bound is closed.
    let mut s = tokio::net::TcpStream::connect(ebb.proxy).await.unwrap();
    s.write_all(b"GET /pid HTTP/1.1\r\nHost: brief.localhost\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    let closed = tokio::time::timeout(LIMIT, async {
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the idle connection was not closed");
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert_eq!(timeouts(ebb.admin, "brief", "connection_idle").await, 1);

    // A WebSocket that moves nothing for the bound is closed; one that talks is not.
    let mut req = format!("ws://{}/ws", ebb.proxy)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("host", "brief.localhost".parse().unwrap());
    let (mut ws, resp) = tokio_tungstenite::connect_async(req).await.unwrap();
    assert_eq!(resp.status(), 101);
    // Messages every 100 ms for twice the bound: the talking socket stays open.
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for i in 0..6 {
        tick.tick().await;
        ws.send(Message::text(format!("hello {i}"))).await.unwrap();
        let back = ws.next().await.unwrap().unwrap();
        assert_eq!(back, Message::text(format!("hello {i}")));
    }
    let end = tokio::time::timeout(LIMIT, ws.next())
        .await
        .expect("the idle WebSocket was closed");
    assert!(
        !matches!(end, Some(Ok(Message::Text(_) | Message::Binary(_)))),
        "{end:?}"
    );
    common::controlplane::wait_until("the WebSocket's idle end is counted", LIMIT, || async {
        (timeouts(ebb.admin, "brief", "connection_idle").await == 2).then_some(())
    })
    .await;
}
