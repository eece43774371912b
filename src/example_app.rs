//! `ebb example-app`: a small HTTP app built into ebb, so demos, tests and benchmarks need no
//! Python or Node. It listens on `--port` (or `$PORT`), after an optional start-up delay, and serves:
//!
//! | path | answer |
//! |---|---|
//! | `/health` | 200 `ok` (503 with `--never-ready`) |
//! | (any, with `--answer-delay-ms N`) | the same answer, N ms late (a slow replica) |
//! | (any, with `--report-load L`) | the same answer, with `X-Runner-Load: L` |
//! | `/pid` | the process id, so tests can tell replicas apart |
//! | `/sleep?ms=N` | 200 after N milliseconds (a long request) |
//! | `/bytes?n=N` | N bytes, streamed (downloads) |
//! | `/ws` | WebSocket echo |
//! | `/count` | reads the whole request body, then answers how many bytes it had |
//! | `/headers` | the request headers it received, a `name: value` line each |
//! | `/crash` | exits the process with status 3 |
//! | a gRPC call (`content-type: application/grpc...`) | unary echo: the request's messages back, `grpc-status: 0` |
//! | `POST /` with `--function F` | demo function F (below) |
//! | anything else | echo: the request body streamed back, method and path in headers |
//!
//! It speaks HTTP/1.1 and HTTP/2 without TLS (h2c, prior knowledge), so gRPC clients reach it
//! directly and benchmarks can ask both.
//!
//! Demo functions, for function templates (`--function`, or `$EBB_FUNCTION`, which ebb sets to
//! the template's `function`): `upper`, `lower`, `reverse` and `exclaim` (appends `!`) transform
//! the body; `classify` passes it on unchanged and answers `X-Ebb-Branch: right` when it is
//! longer than 10 bytes, `left` otherwise; `fail` answers 500; anything else echoes.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, Request};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;

/// Arguments of `ebb example-app`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExampleAppArgs {
    /// Port to listen on.
    #[arg(long, env = "PORT")]
    pub port: u16,
    /// Address to listen on (a pod's IP on Kubernetes).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Wait this long before listening, like an app with a slow start.
    #[arg(long, default_value_t = 0)]
    pub startup_delay_ms: u64,
    /// Answer `/health` with 503 forever: an app that never becomes ready.
    #[arg(long)]
    pub never_ready: bool,
    /// Serve `POST /` as this demo function (see the module docs).
    #[arg(long, env = "EBB_FUNCTION")]
    pub function: Option<String>,
    /// Listen with this accept backlog (the kernel's default bound otherwise), like a dev server
    /// with a small one (Python's `http.server` has 5).
    #[arg(long)]
    pub backlog: Option<u32>,
    /// Wait this long before accepting each connection: a slow accept loop, which with a small
    /// backlog drops the connection attempts that a burst brings beyond it.
    #[arg(long, default_value_t = 0)]
    pub accept_delay_ms: u64,
    /// Answer every request this much late: a slow replica among fast ones.
    #[arg(long, default_value_t = 0)]
    pub answer_delay_ms: u64,
    /// Send `X-Runner-Load: VALUE` with every answer (`in_flight/capacity`): a replica that
    /// reports its load.
    #[arg(long)]
    pub report_load: Option<String>,
}

#[derive(Deserialize)]
struct SleepQuery {
    ms: u64,
}

#[derive(Deserialize)]
struct BytesQuery {
    n: u64,
}

/// Largest `/sleep` the app accepts.
const SLEEP_MAX_MS: u64 = 600_000;
/// Chunk size of `/bytes`.
const CHUNK_BYTES: usize = 64 * 1024;

/// A demo function's answer to `body`: (status, branch, body).
pub fn demo_function(name: &str, body: &[u8]) -> (StatusCode, &'static str, Vec<u8>) {
    let text = String::from_utf8_lossy(body);
    match name {
        "upper" => (StatusCode::OK, "left", text.to_uppercase().into_bytes()),
        "lower" => (StatusCode::OK, "left", text.to_lowercase().into_bytes()),
        "reverse" => (
            StatusCode::OK,
            "left",
            text.chars().rev().collect::<String>().into_bytes(),
        ),
        "exclaim" => (StatusCode::OK, "left", format!("{text}!").into_bytes()),
        "classify" => {
            let branch = if body.len() > 10 { "right" } else { "left" };
            (StatusCode::OK, branch, body.to_vec())
        }
        "fail" => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "left",
            b"failed".to_vec(),
        ),
        _ => (StatusCode::OK, "left", body.to_vec()),
    }
}

/// The app's routes.
pub fn router(never_ready: bool) -> Router {
    router_with(never_ready, None)
}

/// The app's routes, `POST /` served by demo function `function` when given.
pub fn router_with(never_ready: bool, function: Option<String>) -> Router {
    let routes = match function {
        Some(f) => Router::new().route(
            "/",
            axum::routing::post(move |body: axum::body::Bytes| {
                let f = f.clone();
                async move {
                    let (status, branch, out) = demo_function(&f, &body);
                    (status, [("x-ebb-branch", branch)], out)
                }
            }),
        ),
        None => Router::new(),
    };
    routes
        .route(
            "/health",
            get(move || async move {
                if never_ready {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                } else {
                    (StatusCode::OK, "ok")
                }
            }),
        )
        .route("/pid", get(|| async { std::process::id().to_string() }))
        .route(
            "/sleep",
            get(|Query(q): Query<SleepQuery>| async move {
                tokio::time::sleep(Duration::from_millis(q.ms.min(SLEEP_MAX_MS))).await;
                format!("slept {} ms\n", q.ms.min(SLEEP_MAX_MS))
            }),
        )
        .route("/bytes", get(bytes))
        .route("/ws", get(ws))
        .route("/headers", get(headers))
        .route("/count", axum::routing::any(count))
        .route(
            "/crash",
            get(|| async {
                std::process::exit(3);
                #[allow(unreachable_code)]
                ""
            }),
        )
        .fallback(echo)
}

async fn bytes(Query(q): Query<BytesQuery>) -> Response {
    let total = q.n;
    let chunk = bytes_chunk();
    let stream = futures_util::stream::unfold(0u64, move |sent| {
        let chunk = chunk.clone();
        async move {
            if sent >= total {
                return None;
            }
            let n = (total - sent).min(CHUNK_BYTES as u64) as usize;
            Some((Ok::<_, std::io::Error>(chunk.slice(..n)), sent + n as u64))
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        "content-length",
        HeaderValue::from_str(&total.to_string()).expect("digits"),
    );
    r
}

fn bytes_chunk() -> axum::body::Bytes {
    axum::body::Bytes::from(
        (0..CHUNK_BYTES)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    )
}

async fn count(req: Request) -> Result<String, StatusCode> {
    let mut body = req.into_body().into_data_stream();
    let mut n = 0u64;
    while let Some(chunk) = body.next().await {
        n += chunk.map_err(|_| StatusCode::BAD_REQUEST)?.len() as u64;
    }
    Ok(format!("{n} bytes\n"))
}

/// The request's headers, a line each. A body is read to its end first (and dropped): hyper
/// closes a keep-alive connection whose request body was left unread when the answer is done,
/// and a proxy that pooled it would meet the close with its next request.
async fn headers(req: Request) -> String {
    let (parts, body) = req.into_parts();
    let _ = axum::body::to_bytes(body, 1 << 20).await;
    parts
        .headers
        .iter()
        .map(|(k, v)| format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())))
        .collect()
}

async fn ws(upgrade: WebSocketUpgrade) -> Response {
    upgrade.on_upgrade(|socket: WebSocket| async move {
        let (mut tx, mut rx) = socket.split();
        while let Some(Ok(msg)) = rx.next().await {
            let reply = match msg {
                Message::Text(t) => Message::Text(t),
                Message::Binary(b) => Message::Binary(b),
                Message::Close(_) => break,
                _ => continue,
            };
            if tx.send(reply).await.is_err() {
                break;
            }
        }
    })
}

/// A unary gRPC echo: the request's length-prefixed messages are a valid answer to any method
/// whose reply has the request's type (the benchmarks' `helloworld.Greeter/SayHello`, whose
/// request and reply are both one string field 1).
async fn grpc_echo(req: Request) -> Response {
    use http_body_util::BodyExt;
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return StatusCode::BAD_REQUEST.into_response(),
    };
    let mut trailers = axum::http::HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let frames = futures_util::stream::iter([
        Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(body)),
        Ok(hyper::body::Frame::trailers(trailers)),
    ]);
    let mut r = Response::new(Body::new(http_body_util::StreamBody::new(frames)));
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    r
}

async fn echo(req: Request) -> Response {
    if req
        .headers()
        .get("content-type")
        .is_some_and(|v| crate::proxy::grpc::is_grpc_content_type(v.as_bytes()))
    {
        return grpc_echo(req).await;
    }
    let method = req.method().to_string();
    let path = req.uri().to_string();
    let mut r = Response::new(Body::new(req.into_body()));
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&method) {
        h.insert("x-echo-method", v);
    }
    if let Ok(v) = HeaderValue::from_str(&path) {
        h.insert("x-echo-path", v);
    }
    h.insert(
        "x-echo-pid",
        HeaderValue::from_str(&std::process::id().to_string()).expect("digits"),
    );
    r
}

/// Runs the app until the process is stopped.
pub async fn run(args: ExampleAppArgs) -> anyhow::Result<()> {
    if args.startup_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(args.startup_delay_ms)).await;
    }
    let addr = SocketAddr::new(args.host, args.port);
    let listen = || -> std::io::Result<tokio::net::TcpListener> {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(args.backlog.unwrap_or(1024))
    };
    let listener =
        listen().map_err(|e| anyhow::anyhow!("example-app: listening on {addr}: {e}"))?;
    let mut app = router_with(args.never_ready, args.function);
    if args.answer_delay_ms > 0 || args.report_load.is_some() {
        let delay = Duration::from_millis(args.answer_delay_ms);
        let load = args
            .report_load
            .as_deref()
            .map(HeaderValue::from_str)
            .transpose()
            .map_err(|e| anyhow::anyhow!("example-app: --report-load: {e}"))?;
        app = app.layer(axum::middleware::from_fn(
            move |req: Request, next: axum::middleware::Next| {
                let load = load.clone();
                async move {
                    tokio::time::sleep(delay).await;
                    let mut r = next.run(req).await;
                    if let Some(l) = load {
                        r.headers_mut().insert("x-runner-load", l);
                    }
                    r
                }
            },
        ));
    }
    if args.accept_delay_ms > 0 {
        let slow = SlowAccept {
            inner: listener,
            delay: Duration::from_millis(args.accept_delay_ms),
        };
        axum::serve(slow, app).await?;
    } else {
        axum::serve(listener, app).await?;
    }
    Ok(())
}

/// A listener that waits before each accept.
struct SlowAccept {
    inner: tokio::net::TcpListener,
    delay: Duration,
}

impl axum::serve::Listener for SlowAccept {
    type Io = tokio::net::TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            tokio::time::sleep(self.delay).await;
            match self.inner.accept().await {
                Ok(pair) => return pair,
                Err(e) => tracing::debug!(error = %e, "accept failed"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}
