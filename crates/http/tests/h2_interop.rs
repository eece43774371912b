//! ebb's HTTP/2 server side ([`ebb_http::h2server`]) against the `h2` crate's client, over an
//! in-memory pipe: many requests at once on one connection, and bodies larger than every
//! window both ways, so the two sides' flow control must agree; and against h2spec, the HTTP/2
//! conformance suite (built from its Go module by `scripts/h2spec`), over loopback.

use std::collections::HashMap;

use bytes::Bytes;
use ebb_http::h2server::{Config, Event, Server};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};

/// What a request without a body gets as its answer's body: enough bytes for h2spec's flow
/// control cases.
const NO_BODY_ANSWER: &[u8] = &[b'e'; 1024];

/// Serves one connection: each request is answered with its path, its body's length and its
/// body ([`NO_BODY_ANSWER`] when it had none), written as the windows allow. A connection error
/// ends it once its GOAWAY is written.
async fn serve(mut io: impl AsyncRead + AsyncWrite + Unpin, config: Config) {
    let mut server = Server::new(config);
    let mut buf = Vec::new();
    let mut events = Vec::new();
    let mut bodies: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut paths: HashMap<u32, Vec<u8>> = HashMap::new();
    // Answers waiting for a window: stream, what is left.
    let mut pending: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut chunk = vec![0; 64 * 1024];
    loop {
        let out = std::mem::take(server.out());
        if !out.is_empty() && io.write_all(&out).await.is_err() {
            return;
        }
        if server.failed() {
            return;
        }
        let n = match io.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        let Ok(used) = server.recv(&buf, &mut events) else {
            // A connection error: its GOAWAY, then the end.
            let out = std::mem::take(server.out());
            let _ = io.write_all(&out).await;
            return;
        };
        let mut ended = Vec::new();
        for e in events.drain(..) {
            match e {
                Event::Request {
                    stream,
                    head,
                    end_stream,
                } => {
                    paths.insert(stream, head.path);
                    bodies.insert(stream, Vec::new());
                    if end_stream {
                        ended.push(stream);
                    }
                }
                Event::Data {
                    stream,
                    data,
                    end_stream,
                } => {
                    if let Some(body) = bodies.get_mut(&stream) {
                        body.extend_from_slice(&buf[data.clone()]);
                    }
                    server.consumed(stream, data.len());
                    if end_stream {
                        ended.push(stream);
                    }
                }
                Event::Reset { stream, .. } => {
                    bodies.remove(&stream);
                    paths.remove(&stream);
                    pending.remove(&stream);
                }
                Event::Trailers { stream, .. } => ended.push(stream),
                Event::Writable { .. } | Event::GoAway { .. } => {}
            }
        }
        buf.drain(..used);
        for stream in ended {
            let (Some(body), Some(path)) = (bodies.remove(&stream), paths.remove(&stream)) else {
                continue;
            };
            let len = body.len().to_string();
            let fields = [
                (&b"x-path"[..], &path[..]),
                (&b"x-length"[..], len.as_bytes()),
            ];
            if server.respond(stream, 200, fields, false).is_ok() {
                let body = if body.is_empty() {
                    NO_BODY_ANSWER.to_vec()
                } else {
                    body
                };
                pending.insert(stream, body);
            }
        }
        // Whatever the windows let go now (a stream reset meanwhile is dropped).
        pending.retain(|&stream, left| match server.send_data(stream, left, true) {
            Ok(n) => {
                left.drain(..n);
                !left.is_empty()
            }
            Err(_) => false,
        });
    }
}

async fn client(io: DuplexStream) -> h2::client::SendRequest<Bytes> {
    let (send, conn) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    send
}

async fn request(
    send: &mut h2::client::SendRequest<Bytes>,
    path: &str,
    body: Vec<u8>,
) -> (String, usize, Vec<u8>) {
    let req = http::Request::post(format!("http://ebb.test{path}"))
        .body(())
        .unwrap();
    let mut send = send.clone().ready().await.unwrap();
    let (answer, mut stream) = send.send_request(req, body.is_empty()).unwrap();
    if !body.is_empty() {
        // Sent as the server's windows allow.
        let mut left = Bytes::from(body);
        while !left.is_empty() {
            stream.reserve_capacity(left.len());
            let cap = std::future::poll_fn(|cx| stream.poll_capacity(cx))
                .await
                .unwrap()
                .unwrap();
            let part = left.split_to(cap.min(left.len()));
            stream.send_data(part, left.is_empty()).unwrap();
        }
    }
    let answer = answer.await.unwrap();
    assert_eq!(answer.status(), 200);
    let header = |n: &str| answer.headers()[n].to_str().unwrap().to_owned();
    let (path, len) = (header("x-path"), header("x-length").parse().unwrap());
    let mut body = answer.into_body();
    let mut got = Vec::new();
    while let Some(data) = body.data().await {
        let data = data.unwrap();
        body.flow_control().release_capacity(data.len()).unwrap();
        got.extend_from_slice(&data);
    }
    (path, len, got)
}

#[tokio::test]
async fn many_requests_at_once_on_one_connection() {
    let (a, b) = tokio::io::duplex(16 * 1024);
    let server = tokio::spawn(serve(b, Config::default()));
    let mut send = client(a).await;
    let mut all = Vec::new();
    for i in 0..200 {
        let mut send = send.clone();
        all.push(tokio::spawn(async move {
            let body = if i % 2 == 0 {
                Vec::new()
            } else {
                vec![i as u8; i * 10]
            };
            let (path, len, got) = request(&mut send, &format!("/r/{i}"), body.clone()).await;
            assert_eq!(path, format!("/r/{i}"));
            assert_eq!(len, body.len());
            if body.is_empty() {
                assert_eq!(got, NO_BODY_ANSWER);
            } else {
                assert_eq!(got, body);
            }
        }));
    }
    for t in all {
        t.await.unwrap();
    }
    let _ = request(&mut send, "/last", Vec::new()).await;
    drop(send);
    server.abort();
}

#[tokio::test]
async fn bodies_larger_than_every_window_go_both_ways() {
    let (a, b) = tokio::io::duplex(64 * 1024);
    // Small windows on this side, so the client waits for its WINDOW_UPDATEs.
    let config = Config {
        initial_window_size: 65_535,
        connection_window: 100_000,
        ..Config::default()
    };
    let server = tokio::spawn(serve(b, config));
    let send = client(a).await;
    let body: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let mut all = Vec::new();
    for i in 0..3 {
        let mut send = send.clone();
        let body = body.clone();
        all.push(tokio::spawn(async move {
            // The client's windows are the default 65,535: the answer waits for them.
            let (path, len, got) = request(&mut send, &format!("/big/{i}"), body.clone()).await;
            assert_eq!(path, format!("/big/{i}"));
            assert_eq!(len, body.len());
            assert!(got == body, "the body came back whole");
        }));
    }
    for t in all {
        t.await.unwrap();
    }
    drop(send);
    server.abort();
}

/// h2spec's every case (its generic ones, RFC 7540's and HPACK's) against the server side over
/// loopback, each connection served as above.
#[tokio::test]
async fn h2spec_passes() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let h2spec = match std::env::var("EBB_H2SPEC") {
        Ok(p) => p,
        Err(_) => {
            let built = std::process::Command::new(format!("{root}/scripts/h2spec"))
                .arg("build")
                .output()
                .expect("scripts/h2spec runs");
            assert!(built.status.success(), "scripts/h2spec build: {built:?}");
            String::from_utf8(built.stdout).unwrap().trim().to_owned()
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        loop {
            let (io, _) = listener.accept().await.unwrap();
            tokio::spawn(serve(io, Config::default()));
        }
    });
    let report = tokio::task::spawn_blocking(move || {
        std::process::Command::new(h2spec)
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-o", "10"])
            .output()
            .expect("h2spec runs")
    })
    .await
    .unwrap();
    server.abort();
    let out = String::from_utf8_lossy(&report.stdout);
    let summary = out
        .lines()
        .rev()
        .find(|l| l.contains("tests,"))
        .unwrap_or("");
    assert!(
        report.status.success() && summary.contains(" 0 failed"),
        "h2spec: {summary}\n{out}"
    );
}
