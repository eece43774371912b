//! The limits clients can reach, each set low on a real `ebb serve`: each gives its clear 4xx or
//! 503 with a JSON body, counts in `ebb_limit_refusals_total{limit}`, and ebb goes on serving.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::http::{client, send_json};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(30);

/// Sends raw bytes and reads one answer's status and JSON body (ebb's refusals are framed by
/// Content-Length), or `None` when the connection closed first.
async fn raw(addr: SocketAddr, bytes: &[u8]) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    read_answer(&mut s).await
}

async fn read_answer(s: &mut TcpStream) -> Option<(u16, Value)> {
    let mut buf = Vec::new();
    loop {
        let mut hs = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut hs);
        if let Ok(httparse::Status::Complete(n)) = r.parse(&buf) {
            let len: usize = r
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                .unwrap_or(0);
            let status = r.code.unwrap();
            while buf.len() < n + len {
                let mut chunk = [0u8; 4096];
                let k = tokio::time::timeout(DEADLINE, s.read(&mut chunk))
                    .await
                    .expect("the body in time")
                    .unwrap();
                assert!(k > 0, "the body ended early");
                buf.extend_from_slice(&chunk[..k]);
            }
            let body = serde_json::from_slice(&buf[n..n + len]).unwrap_or(Value::Null);
            return Some((status, body));
        }
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout(DEADLINE, s.read(&mut chunk))
            .await
            .expect("an answer or a close in time")
        {
            Ok(0) | Err(_) => return None,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
}

/// `n` connections open at once, each with a request answered (proof that it was accepted and
/// counted), retried until the proxy takes that many: connections refused or closed before
/// linger a moment, and their slots come back only once the server has seen them close.
async fn served_at_once(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let good = b"GET /pid HTTP/1.1\r\nHost: edge.localhost\r\n\r\n";
    let what = format!("{n} connections served at once");
    common::controlplane::wait_until(&what, DEADLINE, || async {
        let mut open = Vec::new();
        for _ in 0..n {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(good).await.unwrap();
            match read_answer(&mut s).await {
                Some((200, _)) => open.push(s),
                _ => return None,
            }
        }
        Some(open)
    })
    .await
}

/// `ebb_limit_refusals_total{limit}` from `/metrics`.
async fn refusals(admin: SocketAddr, limit: &str) -> u64 {
    let want = format!("ebb_limit_refusals_total{{limit=\"{limit}\"}}");
    common::http::sample(&client(), admin, &want).await
}

fn config(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("ebb.toml");
    std::fs::write(
        &path,
        "[[app]]\nname = \"edge\"\ndomains = [\"edge.localhost\"]\n\
         command = [\"ebb\", \"example-app\"]\nidle_after_ms = 60000\n\n\
         [[app]]\nname = \"never\"\ndomains = [\"never.localhost\"]\n\
         command = [\"sleep\", \"600\"]\nstartup_timeout_ms = 600000\nhold_timeout_ms = 600000\n",
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_limits_refuse_clearly_and_count() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&config(dir.path())),
        Some("admin"),
        &[
            "--max-head-bytes",
            "2048",
            "--max-headers",
            "10",
            "--header-read-timeout-ms",
            "300",
            "--max-connections",
            "4",
            "--max-held",
            "1",
            "--max-api-body-bytes",
            "1024",
        ],
    );
    let good = b"GET /pid HTTP/1.1\r\nHost: edge.localhost\r\n\r\n";
    assert_eq!(raw(ebb.proxy, good).await.unwrap().0, 200);

    // A head over --max-head-bytes.
    let big = format!(
        "GET / HTTP/1.1\r\nHost: edge.localhost\r\nX-Big: {}\r\n\r\n",
        "a".repeat(3000)
    );
    let (status, body) = raw(ebb.proxy, big.as_bytes()).await.unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (431, Some("head_too_large"))
    );
    assert!(body["error"].as_str().unwrap().contains("--max-head-bytes"));

    // More header lines than --max-headers.
    let many: String = (0..12).map(|i| format!("X-H{i}: v\r\n")).collect();
    let head = format!("GET / HTTP/1.1\r\nHost: edge.localhost\r\n{many}\r\n");
    let (status, body) = raw(ebb.proxy, head.as_bytes()).await.unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (431, Some("too_many_headers"))
    );

    // A head that never ends: 408 once the header-read timeout passes, however it trickles.
    let mut slow = TcpStream::connect(ebb.proxy).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: edge.loc")
        .await
        .unwrap();
    let (status, body) = read_answer(&mut slow).await.unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (408, Some("header_read_timeout"))
    );

    // Connections past --max-connections: four idle ones are open, the fifth is refused.
    // Refused connections above linger a moment before they close: until they have, fewer
    // than four are free.
    let open = served_at_once(ebb.proxy, 4).await;
    let (status, body) = raw(ebb.proxy, good).await.unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("too_many_connections"))
    );
    drop(open);

    // Held requests past --max-held: two cold requests at once to an app that never gets
    // ready; one waits, the other is refused at once, so the first answer is the refusal.
    // Both go on connections already answered once, so the connection bound (its freed
    // slots come back only as the server sees the closes above) cannot be what refuses.
    let mut two = served_at_once(ebb.proxy, 2).await;
    let (mut b, mut a) = (two.pop().unwrap(), two.pop().unwrap());
    let cold = b"GET / HTTP/1.1\r\nHost: never.localhost\r\n\r\n";
    a.write_all(cold).await.unwrap();
    b.write_all(cold).await.unwrap();
    let first = tokio::select! {
        r = read_answer(&mut a) => r,
        r = read_answer(&mut b) => r,
    };
    let (status, body) = first.expect("the refusal");
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("too_many_held"))
    );

    // An API body past --max-api-body-bytes.
    let c = client();
    let big = json!({ "name": "x", "pad": "a".repeat(2000) });
    let r = send_json(
        &c,
        ebb.admin,
        "PUT",
        "/admin/routes/x",
        &[("authorization", "Bearer admin")],
        &big,
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["code"], "payload_too_large");

    for limit in [
        "max_head_bytes",
        "max_headers",
        "header_read_timeout",
        "max_held",
        "max_connections",
        "max_api_body_bytes",
    ] {
        assert!(refusals(ebb.admin, limit).await >= 1, "{limit} counted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_queued_per_target_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&config(dir.path())),
        None,
        &[
            "--runner-token",
            "rt",
            "--runner-capacity",
            "0",
            "--max-queued-per-target",
            "2",
        ],
    );
    let c = client();
    let auth = [("authorization", "Bearer rt")];
    for _ in 0..2 {
        let r = send_json(
            &c,
            ebb.admin,
            "POST",
            "/runner/enqueue",
            &auth,
            &json!({"target": "edge"}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = send_json(
        &c,
        ebb.admin,
        "POST",
        "/runner/enqueue",
        &auth,
        &json!({"target": "edge"}),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("retry-after"), "1");
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["code"], "target_queue_full");
    // Another target still has room.
    let r = send_json(
        &c,
        ebb.admin,
        "POST",
        "/runner/enqueue",
        &auth,
        &json!({"target": "never"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(refusals(ebb.admin, "max_queued_per_target").await >= 1);
}

#[test]
fn bad_limit_values_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, value, says) in [
        (
            "--max-headers",
            "0",
            "--max-headers must be between 1 and 100",
        ),
        (
            "--max-headers",
            "500",
            "--max-headers must be between 1 and 100",
        ),
        ("--max-head-bytes", "10", "--max-head-bytes must be between"),
        (
            "--max-connections",
            "0",
            "--max-connections must be at least 1",
        ),
    ] {
        let err = common::serve_refused(&dir.path().join("data"), [flag, value]);
        assert!(err.contains(says), "{flag} {value}: {err}");
    }
}
