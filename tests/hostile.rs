//! Hostile and malformed HTTP/1.x against a real `ebb serve`: its proxy, its admin API and its
//! runner API. Each input (request smuggling shapes, duplicate and conflicting framing,
//! oversized and malformed heads, obsolete line folding, bare LF, NUL and control bytes,
//! absolute-form targets for other hosts, CONNECT, an HTTP/2 preface) is followed by a smuggled
//! request. Each must get a 4xx/5xx or a clean close, never an answer to the smuggled request, and
//! the server must then answer a good request, on the same connection when it stayed open, and
//! on a new one.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(20);

/// One server under test: where, how its requests are made, and the good request.
struct Api {
    name: &'static str,
    addr: SocketAddr,
    /// Header lines every request carries (Host, Authorization).
    lines: String,
    get: &'static str,
    post: &'static str,
    post_body: &'static str,
    good: String,
    good_status: u16,
}

/// What the server did with bytes it was sent.
#[derive(Debug)]
enum Seen {
    /// It closed (or reset) the connection without an answer.
    Closed,
    /// It answered HTTP/1.x; `close` when it said it would close; `smuggled` when the answer is
    /// the smuggled request's (the example app echoes the path it was asked).
    Answer {
        status: u16,
        close: bool,
        smuggled: bool,
    },
    /// It answered in HTTP/2 frames (h2c with prior knowledge).
    H2,
}

struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
    eof: bool,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Conn {
        Conn {
            s: TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
            eof: false,
        }
    }

    /// Sends bytes; the server may have closed already, which is not an error here.
    async fn send(&mut self, bytes: &[u8]) {
        let _ = self.s.write_all(bytes).await;
    }

    /// Reads more; false at the end of the stream (or a reset).
    async fn more(&mut self) -> bool {
        if self.eof {
            return false;
        }
        let mut chunk = [0u8; 16 * 1024];
        match tokio::time::timeout(DEADLINE, self.s.read(&mut chunk)).await {
            Err(_) => panic!(
                "no answer and no close within {DEADLINE:?}: {:?}",
                String::from_utf8_lossy(&self.buf)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => {
                self.eof = true;
                false
            }
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    /// The next answer, read whole (its body by its framing), or how the connection ended.
    async fn next(&mut self, to_head: bool) -> Seen {
        loop {
            if self.buf.first() == Some(&0) {
                // An HTTP/2 frame (its length's first byte): HTTP/1 answers begin with "HTTP".
                return Seen::H2;
            }
            let mut hs = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut hs);
            match r.parse(&self.buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let status = r.code.unwrap();
                    let smuggled = String::from_utf8_lossy(&self.buf[..n]).contains("/smuggled");
                    let header = |name: &str| {
                        r.headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case(name))
                            .map(|h| String::from_utf8_lossy(h.value).to_ascii_lowercase())
                    };
                    let close = header("connection").is_some_and(|v| v.contains("close"));
                    let length: Option<usize> =
                        header("content-length").map(|v| v.trim().parse().unwrap());
                    let chunked =
                        header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
                    let framed_by_close = !chunked && length.is_none();
                    self.buf.drain(..n);
                    if to_head || status == 204 || status == 304 || (100..200).contains(&status) {
                        return Seen::Answer {
                            status,
                            close,
                            smuggled,
                        };
                    }
                    if chunked {
                        while !self.buf.windows(5).any(|w| w == b"0\r\n\r\n") {
                            assert!(self.more().await, "a chunked answer ended early");
                        }
                        let end = self.buf.windows(5).position(|w| w == b"0\r\n\r\n").unwrap();
                        self.buf.drain(..end + 5);
                    } else if let Some(len) = length {
                        while self.buf.len() < len {
                            assert!(self.more().await, "an answer's body ended early");
                        }
                        self.buf.drain(..len);
                    } else if framed_by_close {
                        while self.more().await {}
                        self.buf.clear();
                    }
                    return Seen::Answer {
                        status,
                        close: close || framed_by_close,
                        smuggled,
                    };
                }
                Ok(httparse::Status::Partial) => {
                    if !self.more().await {
                        return Seen::Closed;
                    }
                }
                Err(e) => panic!(
                    "not an HTTP/1.x answer ({e}): {:?}",
                    String::from_utf8_lossy(&self.buf)
                ),
            }
        }
    }

    /// Whether the server closes the connection with nothing more to say.
    async fn closes_quietly(&mut self) -> bool {
        while self.more().await {}
        let rest = String::from_utf8_lossy(&self.buf);
        !rest.contains("HTTP/1.") && !rest.contains("/smuggled")
    }
}

/// Inputs whose head ends where every reader agrees: after their refusal, the request that
/// follows them on the connection is a request of its own, and may be answered.
const CLEAR_ENDS: [&str; 14] = [
    "NUL in the target",
    "space in the target",
    "oversized header",
    "oversized target",
    "too many headers",
    "bad method",
    "HTTP/1.2",
    "HTTP/9.9",
    "lower-case version",
    "no version",
    "TLS hello",
    "absolute-form for another host",
    "CONNECT",
    "HTTP/2 preface",
];

/// The hostile inputs, each as (name, bytes) for `api`. `{G}` is its GET path, `{P}` its POST
/// path, `{L}` its header lines, `{B}` a body its POST takes.
fn corpus(api: &Api) -> Vec<(String, Vec<u8>)> {
    let big = "a".repeat(100 * 1024);
    let many: String = (0..300).map(|i| format!("X-H{i}: v\r\n")).collect();
    let text: Vec<(&str, String)> = vec![
        (
            "CL.TE",
            "POST {P} HTTP/1.1\r\n{L}Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX".into(),
        ),
        (
            "TE.CL",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n".into(),
        ),
        (
            "two Content-Lengths",
            "POST {P} HTTP/1.1\r\n{L}Content-Length: 3\r\nContent-Length: 40\r\n\r\n{B}".into(),
        ),
        (
            "Content-Length list that disagrees",
            "POST {P} HTTP/1.1\r\n{L}Content-Length: 3, 40\r\n\r\n{B}".into(),
        ),
        (
            "signed Content-Length",
            "POST {P} HTTP/1.1\r\n{L}Content-Length: +3\r\n\r\n{B}".into(),
        ),
        (
            "hex Content-Length",
            "POST {P} HTTP/1.1\r\n{L}Content-Length: 0x3\r\n\r\n{B}".into(),
        ),
        (
            "Content-Length past u64",
            "POST {P} HTTP/1.1\r\n{L}Content-Length: 99999999999999999999999\r\n\r\n{B}".into(),
        ),
        (
            "space before the colon",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding : chunked\r\nContent-Length: 3\r\n\r\n{B}".into(),
        ),
        (
            "unknown transfer coding",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: xchunked\r\n\r\n{B}".into(),
        ),
        (
            "chunked not last",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: chunked, identity\r\n\r\n{B}".into(),
        ),
        (
            "two Transfer-Encodings",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n{B}".into(),
        ),
        (
            "Transfer-Encoding folded",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding:\r\n chunked\r\n\r\n{B}".into(),
        ),
        (
            "obsolete line folding",
            "GET {G} HTTP/1.1\r\n{L}X-Folded: a\r\n b\r\n\r\n".into(),
        ),
        (
            "negative chunk size",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: chunked\r\n\r\n-3\r\nabc\r\n0\r\n\r\n".into(),
        ),
        (
            "chunk size past u64",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: chunked\r\n\r\nfffffffffffffffff1\r\nabc\r\n0\r\n\r\n".into(),
        ),
        (
            "chunk with bare LF",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: chunked\r\n\r\n3\nabc\n0\n\n".into(),
        ),
        (
            "chunk longer than its size",
            "POST {P} HTTP/1.1\r\n{L}Transfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n".into(),
        ),
        (
            "bare LF head",
            "GET {G} HTTP/1.1\n{LF}\n".into(),
        ),
        (
            "bare CR in a header",
            "GET {G} HTTP/1.1\r\n{L}X-A: a\rb\r\n\r\n".into(),
        ),
        (
            "NUL in a header value",
            "GET {G} HTTP/1.1\r\n{L}X-A: a\0b\r\n\r\n".into(),
        ),
        (
            "control byte in a header name",
            "GET {G} HTTP/1.1\r\n{L}X\x01A: b\r\n\r\n".into(),
        ),
        ("NUL in the target", "GET /\0 HTTP/1.1\r\n{L}\r\n".into()),
        (
            "space in the target",
            "GET /a b HTTP/1.1\r\n{L}\r\n".into(),
        ),
        (
            "oversized header",
            format!("GET {{G}} HTTP/1.1\r\n{{L}}X-Big: {big}\r\n\r\n"),
        ),
        (
            "oversized target",
            format!("GET /{big} HTTP/1.1\r\n{{L}}\r\n"),
        ),
        (
            "too many headers",
            format!("GET {{G}} HTTP/1.1\r\n{{L}}{many}\r\n"),
        ),
        ("bad method", "G@T {G} HTTP/1.1\r\n{L}\r\n".into()),
        ("HTTP/1.2", "GET {G} HTTP/1.2\r\n{L}\r\n".into()),
        ("HTTP/9.9", "GET {G} HTTP/9.9\r\n{L}\r\n".into()),
        ("lower-case version", "GET {G} http/1.1\r\n{L}\r\n".into()),
        ("no version", "GET {G}\r\n{L}\r\n".into()),
        ("TLS hello", "\x16\x03\x01\x02\x00\x01\x00\x01\x7c\x03\x03\r\n\r\n".into()),
        (
            "absolute-form for another host",
            "GET http://elsewhere.example{G} HTTP/1.1\r\n{L}\r\n".into(),
        ),
        (
            "CONNECT",
            "CONNECT elsewhere.example:443 HTTP/1.1\r\n{L}\r\n".into(),
        ),
        (
            "HTTP/2 preface",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nGET {G} HTTP/1.1\r\n{L}\r\n".into(),
        ),
        (
            "HTTP/1.0 CL.TE",
            "POST {P} HTTP/1.0\r\n{L}Connection: keep-alive\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX".into(),
        ),
    ];
    let lf = api.lines.replace("\r\n", "\n");
    text.into_iter()
        .map(|(name, t)| {
            let mut bytes = t
                .replace("{G}", api.get)
                .replace("{P}", api.post)
                .replace("{LF}", &lf)
                .replace("{L}", &api.lines)
                .replace("{B}", api.post_body)
                .into_bytes();
            // What a desynchronised server would answer next.
            bytes.extend_from_slice(
                format!("GET /smuggled HTTP/1.1\r\n{}\r\n", api.lines).as_bytes(),
            );
            (name.to_owned(), bytes)
        })
        .collect()
}

/// Sends the good request on `c` and checks its answer.
async fn good(api: &Api, c: &mut Conn, what: &str) {
    c.send(api.good.as_bytes()).await;
    match c.next(false).await {
        Seen::Answer {
            status, smuggled, ..
        } => {
            assert!(
                !smuggled,
                "{}: {what}: the smuggled request was answered",
                api.name
            );
            assert_eq!(
                status, api.good_status,
                "{}: {what}: the good request after it got another answer",
                api.name
            )
        }
        other => panic!("{}: {what}: the good request got {other:?}", api.name),
    }
}

async fn survive(api: &Api) {
    let mut fresh = Conn::open(api.addr).await;
    good(api, &mut fresh, "first").await;
    for (name, bytes) in corpus(api) {
        eprintln!("{}: {name}", api.name);
        let mut c = Conn::open(api.addr).await;
        c.send(&bytes).await;
        let seen = c.next(false).await;
        match seen {
            Seen::Closed => {}
            Seen::H2 => {
                // Both listeners speak h2c with prior knowledge: what follows the preface is not
                // an HTTP/2 frame, and the connection ends.
                assert_eq!(name, "HTTP/2 preface", "{}: h2 answers only h2", api.name);
                assert!(
                    c.closes_quietly().await || c.eof,
                    "{name}: h2c ends the connection"
                );
            }
            Seen::Answer {
                status,
                close,
                smuggled,
            } => {
                assert!(
                    !smuggled,
                    "{}: {name}: the smuggled request was answered",
                    api.name
                );
                if status >= 400 && !close && CLEAR_ENDS.contains(&name.as_str()) {
                    // The request after it is one of its own: answered, or the connection closed.
                    if let Seen::H2 = c.next(false).await {
                        panic!("{}: {name}: h2 after an HTTP/1 answer", api.name);
                    }
                }
                if c.eof {
                    // Closed after the refusal.
                } else if status < 400 || close {
                    assert!(
                        c.closes_quietly().await,
                        "{}: {name}: answered {status}, then not closed, or answered again",
                        api.name
                    );
                } else {
                    // Still open: the next answer must be the good request's, not the smuggled one.
                    c.send(api.good.as_bytes()).await;
                    match c.next(false).await {
                        Seen::Closed => {}
                        Seen::Answer {
                            status: s,
                            smuggled,
                            ..
                        } => {
                            assert!(
                                !smuggled,
                                "{}: {name}: the smuggled request was answered",
                                api.name
                            );
                            assert_eq!(
                                s, api.good_status,
                                "{}: {name}: after {status}, the next answer was not the good request's",
                                api.name
                            )
                        }
                        Seen::H2 => panic!("{}: {name}: h2 after an HTTP/1 answer", api.name),
                    }
                }
                assert!(
                    status >= 400 || close || c.eof,
                    "{}: {name}: answered {status}",
                    api.name
                );
            }
        }
        let mut fresh = Conn::open(api.addr).await;
        good(api, &mut fresh, &format!("after {name}")).await;
    }
}

/// `ebb.toml` with the app `edge` (`edge.localhost`), written in `dir`.
fn edge_config(dir: &std::path::Path) -> std::path::PathBuf {
    let config = dir.join("ebb.toml");
    std::fs::write(
        &config,
        "[[app]]\nname = \"edge\"\ndomains = [\"edge.localhost\"]\n\
         command = [\"ebb\", \"example-app\"]\nidle_after_ms = 60000\n",
    )
    .unwrap();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_and_apis_survive_hostile_http() {
    let dir = tempfile::tempdir().unwrap();
    let config = edge_config(dir.path());
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&config),
        Some("admin-secret"),
        &["--runner-token", "runner-secret"],
    );
    let proxy = Api {
        name: "proxy",
        addr: ebb.proxy,
        lines: "Host: edge.localhost\r\n".into(),
        get: "/headers",
        post: "/count",
        post_body: "abc",
        good: "GET /pid HTTP/1.1\r\nHost: edge.localhost\r\n\r\n".into(),
        good_status: 200,
    };
    let admin = Api {
        name: "admin API",
        addr: ebb.admin,
        lines: "Host: 127.0.0.1\r\nAuthorization: Bearer admin-secret\r\n".into(),
        get: "/admin/routes",
        post: "/admin/routes",
        post_body: "abc",
        good: "GET /admin/routes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer admin-secret\r\n\r\n"
            .into(),
        good_status: 200,
    };
    let runner = Api {
        name: "runner API",
        addr: ebb.admin,
        lines: "Host: 127.0.0.1\r\nAuthorization: Bearer runner-secret\r\n".into(),
        get: "/v1/calls",
        post: "/runner/dequeue",
        post_body: "{\"runner\":\"r1\"}",
        good: "POST /runner/dequeue HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer runner-secret\r\nContent-Length: 15\r\n\r\n{\"runner\":\"r1\"}"
            .into(),
        good_status: 204,
    };
    for api in [&proxy, &admin, &runner] {
        survive(api).await;
    }
}

/// Everything the server sends on a connection until it closes it, as text.
async fn until_closed(addr: SocketAddr, bytes: &[u8]) -> String {
    String::from_utf8_lossy(&bytes_until_closed(addr, bytes).await).into_owned()
}

/// Everything the server sends on a connection until it closes it.
async fn bytes_until_closed(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    match tokio::time::timeout(DEADLINE, s.read_to_end(&mut out)).await {
        Ok(_) => out,
        Err(_) => panic!(
            "not closed within {DEADLINE:?}: {:?}",
            String::from_utf8_lossy(&out)
        ),
    }
}

/// A head with a line ending in LF alone gets the same 400 on the proxy's HTTP/1.1 path and on
/// its general path (hyper: HTTP/1.0, and what follows a request handed over on a connection),
/// and the connection ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_lf_is_refused_alike_on_both_proxy_paths() {
    let dir = tempfile::tempdir().unwrap();
    let config = edge_config(dir.path());
    let ebb = common::serve_with(&dir.path().join("data"), Some(&config), None, &[]);
    let refused = |what: &str, got: &str| {
        let last = got
            .rfind("HTTP/1.")
            .unwrap_or_else(|| panic!("{what}: no answer: {got:?}"));
        let answer = &got[last..];
        assert!(
            answer.starts_with("HTTP/1.1 400 "),
            "{what}: the last answer is not a 400: {got:?}"
        );
        assert!(
            answer.contains("\"code\":\"bad_request\"") && answer.contains("LF without CR"),
            "{what}: {got:?}"
        );
    };
    let fast = until_closed(
        ebb.proxy,
        b"GET /pid HTTP/1.1\nHost: edge.localhost\n\nGET /smuggled HTTP/1.1\r\nHost: edge.localhost\r\n\r\n",
    )
    .await;
    refused("HTTP/1.1 path", &fast);
    let general = until_closed(
        ebb.proxy,
        b"GET /pid HTTP/1.0\nHost: edge.localhost\n\nGET /smuggled HTTP/1.1\r\nHost: edge.localhost\r\n\r\n",
    )
    .await;
    refused("HTTP/1.0 (general path)", &general);
    let handed_over = until_closed(
        ebb.proxy,
        b"GET /pid HTTP/1.0\r\nHost: edge.localhost\r\nConnection: keep-alive\r\n\r\n\
          GET /pid HTTP/1.1\r\nHost: edge.localhost\nX-Late: 1\r\n\r\n",
    )
    .await;
    assert!(
        handed_over.starts_with("HTTP/1.0 200") || handed_over.starts_with("HTTP/1.1 200"),
        "the first request is answered: {handed_over:?}"
    );
    refused("after a handed-over request", &handed_over);
    for got in [&fast, &general, &handed_over] {
        assert!(!got.contains("/smuggled"), "{got:?}");
    }
}

/// The frame types of HTTP/2 frames, in order.
fn frame_types(mut got: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    while got.len() >= 9 {
        let len = u32::from_be_bytes([0, got[0], got[1], got[2]]) as usize;
        types.push(got[3]);
        got = &got[(9 + len).min(got.len())..];
    }
    types
}

/// The same HTTP/2 rules on every port: a protocol error right after the preface is answered
/// GOAWAY and the connection closed; a connection that sends nothing valid (the preface alone,
/// bytes that never make a head) is closed within the header-read timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_port_ends_a_broken_h2_connection_and_one_that_sends_nothing_valid() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve_with(
        &dir.path().join("data"),
        None,
        Some("admin-secret"),
        &[
            "--runner-token",
            "runner-secret",
            "--header-read-timeout-ms",
            "1000",
        ],
    );
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // A SETTINGS frame five bytes long: a FRAME_SIZE_ERROR of the connection.
    let mut malformed = PREFACE.to_vec();
    malformed.extend_from_slice(b"\x00\x00\x05\x04\x00\x00\x00\x00\x00abcde");
    for (port, addr) in [("proxy", ebb.proxy), ("admin and runner", ebb.admin)] {
        let got = bytes_until_closed(addr, &malformed).await;
        let types = frame_types(&got);
        assert_eq!(
            types.last(),
            Some(&7),
            "{port}: a malformed first frame is answered GOAWAY, then the connection closes: {types:?}"
        );
        // Closed (until_closed returns only at the end) though it sent nothing more.
        bytes_until_closed(addr, PREFACE).await;
        bytes_until_closed(addr, b"\x00\x01\x02").await;
    }
}
