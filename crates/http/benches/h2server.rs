//! ebb's HTTP/2 server side ([`ebb_http::h2server`]) against the `h2` crate's server, the one the
//! proxy serves HTTP/2 with now, on the same recorded client bytes: an h2load-like client's
//! preface, settings and GET requests (HPACK with its dynamic table, as nghttp2 writes them),
//! each answered with `200`, two fields and a two-byte body, the answers' bytes thrown away.
//! No sockets, one thread: only the two HTTP/2 implementations' own work is measured. Prints
//! nanoseconds per request for each, over alternating rounds, and their ratio.
//! Run: `benches/h2server.sh [REQUESTS] [ROUNDS]`.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use ebb_core::clock::Stopwatch;
use ebb_http::h2::{self as frames, flag, kind};
use ebb_http::h2server::{Config, Event, Server};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How much is read at once, as from a socket.
const READ: usize = 16 * 1024;

/// A client's bytes for `n` GET requests, on streams 1, 3, 5, ...
fn recorded(n: u32) -> Vec<u8> {
    let mut out = frames::PREFACE.to_vec();
    frames::write_settings(&mut out, &[(frames::setting::ENABLE_PUSH, 0)]);
    // Room for every answer on the connection.
    frames::write_window_update(&mut out, 0, frames::MAX_WINDOW - frames::DEFAULT_WINDOW);
    // As nghttp2 (h2load) writes them: the first request adds its `:authority`, `accept` and
    // `user-agent` to the dynamic table, the others name them by index (seven bytes).
    let literal = |out: &mut Vec<u8>, first: u8, value: &[u8]| {
        out.push(first);
        out.push(value.len() as u8);
        out.extend_from_slice(value);
    };
    let mut first = vec![0x82, 0x84, 0x86];
    literal(&mut first, 0x40 | 1, b"bench.localhost:18502");
    literal(&mut first, 0x40 | 19, b"*/*");
    first.push(0x80 | 16);
    literal(&mut first, 0x40 | 58, b"h2load nghttp2/1.52.0");
    let again = [0x82, 0x84, 0x86, 0x80 | 64, 0x80 | 63, 0x80 | 16, 0x80 | 62];
    for i in 0..n {
        let block: &[u8] = if i == 0 { &first } else { &again };
        frames::write_head(
            &mut out,
            block.len(),
            kind::HEADERS,
            flag::END_HEADERS | flag::END_STREAM,
            2 * i + 1,
        );
        out.extend_from_slice(block);
    }
    out
}

/// ebb's server side on `input`: requests answered as they come.
fn ebb(input: &[u8]) -> usize {
    let mut server = Server::new(Config {
        max_concurrent_streams: 1 << 20,
        ..Config::default()
    });
    let (mut buf, mut events) = (Vec::with_capacity(2 * READ), Vec::new());
    let mut answered = 0;
    for piece in input.chunks(READ) {
        buf.extend_from_slice(piece);
        let used = server
            .recv(&buf, &mut events)
            .expect("the recording keeps the rules");
        for e in events.drain(..) {
            if let Event::Request { stream, .. } = e {
                server
                    .respond(
                        stream,
                        200,
                        [
                            (&b"content-type"[..], &b"text/plain"[..]),
                            (&b"content-length"[..], &b"2"[..]),
                        ],
                        false,
                    )
                    .unwrap();
                server.send_data(stream, b"hi", true).unwrap();
                answered += 1;
            }
        }
        buf.drain(..used);
        server.out().clear();
    }
    answered
}

/// The recorded bytes as a socket: read in pieces of [`READ`], writes thrown away.
struct Replay {
    input: Bytes,
}

impl AsyncRead for Replay {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.input.is_empty() {
            // No end: the h2 crate drops the streams it has not handed out at an end. The
            // caller stops once every request is answered.
            return Poll::Pending;
        }
        let n = self.input.len().min(READ).min(buf.remaining());
        let piece = self.input.split_to(n);
        buf.put_slice(&piece);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Replay {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The `h2` crate's server on `input`, the same answers, until `n` are answered.
async fn h2_crate(input: Bytes, n: usize) -> usize {
    let mut conn = h2::server::Builder::new()
        .max_concurrent_streams(1 << 20)
        .handshake::<_, Bytes>(Replay { input })
        .await
        .unwrap();
    let mut answered = 0;
    while let Some(r) = conn.accept().await {
        let (_, mut respond) = r.unwrap();
        let answer = http::Response::builder()
            .status(200)
            .header("content-type", "text/plain")
            .header("content-length", "2")
            .body(())
            .unwrap();
        let mut send = respond.send_response(answer, false).unwrap();
        send.send_data(Bytes::from_static(b"hi"), true).unwrap();
        answered += 1;
        if answered == n {
            break;
        }
    }
    answered
}

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with('-'));
    let n: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    // The recording says what it means to: its third request names the dynamic table's fields.
    let mut check = Server::new(Config::default());
    let mut events = Vec::new();
    check.recv(&recorded(3), &mut events).unwrap();
    let Some(Event::Request {
        stream: 5, head, ..
    }) = events.last()
    else {
        panic!("{events:?}");
    };
    assert_eq!(head.authority, b"bench.localhost:18502");
    assert_eq!(
        head.fields,
        [
            (b"accept".to_vec(), b"*/*".to_vec()),
            (b"accept-encoding".to_vec(), b"gzip, deflate".to_vec()),
            (b"user-agent".to_vec(), b"h2load nghttp2/1.52.0".to_vec()),
        ]
    );
    let input = recorded(n);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        // One thread, no IO: the time taken is CPU time.
        let t = Stopwatch::start();
        assert_eq!(ebb(&input), n as usize);
        ours.push(t.elapsed().as_nanos());
        let bytes = Bytes::from(input.clone());
        let t = Stopwatch::start();
        assert_eq!(rt.block_on(h2_crate(bytes, n as usize)), n as usize);
        theirs.push(t.elapsed().as_nanos());
    }
    let median = |v: &mut Vec<u128>| {
        v.sort();
        v[v.len() / 2] as f64 / f64::from(n)
    };
    let (o, t) = (median(&mut ours), median(&mut theirs));
    println!(
        "HTTP/2 server side, {n} GET requests from {} recorded bytes, {rounds} alternating rounds, medians",
        input.len()
    );
    println!();
    println!("| server | ns per request |");
    println!("|---|---|");
    println!("| ebb-http h2server | {o:.0} |");
    println!("| h2 crate (hyper's HTTP/2 server) | {t:.0} |");
    println!("| ebb / h2 crate | {:.2} x the time |", o / t);
}
