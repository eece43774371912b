//! The proxy: routes HTTP requests by Host to a ready replica of the route's workload, holding
//! and waking when there is none.
//!
//! * **Threads**: each core runs a proxy thread with its own single-threaded runtime, an
//!   `SO_REUSEPORT` listener and its own backend pool ([`Proxy::spawn_workers`]), so a request
//!   never wakes another thread; each TCP route's port too has a listener on every proxy thread
//!   ([`tcp`]).
//! * **Routing** reads where a request goes with [`head::target`] (exactly one valid `Host`, or
//!   400; an absolute-form target's authority wins over `Host`), then looks the host up in the
//!   routing table ([`table`], a snapshot of the route store in an `ids::Domains` table: port
//!   and case ignored, exact names before `*.suffix` wildcards, one hash lookup for a table
//!   without wildcards; each proxy thread builds its own, so no request counts on a reference
//!   count another core also writes); on the HTTP/1.1 fast path one lookup of the meta
//!   services' table tells both whether the Host is a service's and its rule's route; an
//!   unknown host gets 404 with a JSON error.
//! * **Hold-and-wake**: a request for a workload with no ready replica waits in a bounded per-route
//!   hold (beyond `hold_queue_max`: 503 at once). The first waiter's wake decision is logged once
//!   (single flight, decided on the log's writer, in a task of its own so an abandoned request
//!   cannot cut it short) before the orchestrator is asked to scale; every waiter goes out the
//!   moment a replica is ready; past `hold_timeout_ms` it gets 503 with `Retry-After`. Held
//!   requests are also bounded across routes (`--max-held`). Only a request that must be held
//!   opens a `request` span (its id, the route), under which the wake task runs too, so the
//!   held, woken, forwarded or refused lines about it carry its id. A browser's page load for a
//!   route with a waiting page ([`waiting`]) is answered with the page after the wake starts,
//!   instead of being held. `Proxy::endpoint` is this for a route's replicas, and
//!   `Proxy::endpoint_on` for any list of them (a meta service's `ebb://app` destination).
//! * **Pacing** ([`backends`]): a request takes a slot on the ready replica the route's traffic
//!   policy picks (at most the route's `concurrency` each; the others wait in the hold), and
//!   connections to a replica are opened at most `max_connecting` at a time, an unanswered
//!   connect attempt being made again within `connect_attempt_ms`, so a burst released by a wake
//!   never floods an app with a small accept backlog.
//! * **Forwarding**: HTTP/1.1 requests take the raw-socket path in `h1` (per-thread pools of
//!   keep-alive backend connections, bodies streamed byte for byte); h2c with prior knowledge is
//!   served by ebb's own HTTP/2 server side ([`h2serve`]); HTTP/1.0 and upgrades (WebSocket)
//!   take the general path on hyper; both end in [`Proxy::handle`], which serves the rest of
//!   the connection and tunnels upgrades ([`splice`]). Both add `X-Forwarded-For`, `-Proto`,
//!   `-Host` and `Forwarded`. The general path's HTTP/1.1 hop ([`h1hop`]) writes a body-less
//!   request and reads its answer itself, on the fast path's pooled connections; a request with
//!   a body or an upgrade goes on per-thread pools of hyper connections. Either takes an idle
//!   connection, opens one within the same per-replica bound, or waits for the first of those,
//!   and never opens one it will not use; a request whose client left is dropped with its
//!   connection. Its HTTP/2 ones (gRPC,
//!   h2c destinations) are one per replica and thread (more while the replica's stream limit
//!   fills them), each a task on ebb's own HTTP/2 client side ([`h2hop`]) that the requests'
//!   tasks hand their heads and bodies to. Its bodies are [`Body`]
//!   (`BoxBody<Bytes, BoxError>`), so the proxy can end one itself ([`stream_idle`]). gRPC
//!   ([`grpc`]) takes the general path; TCP
//!   routes ([`tcp`]) have listeners of their own; meta services ([`services`]) route by their
//!   own rules. A request that meets a backend refusing the connection (its body untouched), or
//!   a body-less one whose connection is reset or closed before an answer (the replica is
//!   stopping), wakes the workload again and is retried once on another replica
//!   ([`retry_after_miss`]); a stale pooled connection is first retried on a fresh one. On the
//!   general path the hop that could not connect gives the request back whole
//!   ([`SendError::Connect`]); one cut off after it was sent goes again only when it has no body
//!   (a body the head does not announce by a length, HTTP/2's or a gRPC call's, counts as one).
//! * **Timeouts**, per route, on both paths: the wait for the answer's head
//!   (`response_timeout_ms`, a 504), a request moving no byte (`stream_idle_timeout_ms`), an
//!   idle connection (`connection_idle_timeout_ms`: keep-alive after a request, upgraded and TCP
//!   connections); and the proxy's own bounds on an idle client connection
//!   (`client_idle_timeout_ms`) and a stalled request (`request_stall_timeout_ms`).
//! * **Traffic** is counted in memory ([`Traffic`]): in-flight requests per route (held ones
//!   included; a response counts until its body is done, a request whose client left stops
//!   counting at once) and requests since the last flush. The runtime loops in [`runtime`] flush
//!   it as `RequestsSeen` aggregates and scale idle workloads down. The proxy never writes the log
//!   per request.
//! * **Shutdown**: each proxy thread stops accepting and the proxy drains
//!   ([`Proxy::start_draining`]): every answer from then on says `Connection: close` (HTTP/1.1;
//!   HTTP/2 connections get GOAWAY), and connections idle between requests close at once. It
//!   waits ([`Proxy::drain`], polling the per-route in-flight and held counters) until no
//!   request is under way or held, for at most `--drain-timeout-ms`, and for open tunnels
//!   (WebSocket, TCP routes) [`TUNNEL_DRAIN`] at most; the wake machinery and the apps keep
//!   running meanwhile, and only then are the apps stopped.

// The core's modules under the paths the proxy's files name them by.
use ebb_core::{clock, event, ids, limits, scaler, state};
use ebb_storage::log;

pub mod backends;
pub mod certs;
pub mod discovery;
pub mod gateway;
pub mod grpc;
mod h1;
mod h1hop;
mod h2hop;
mod h2parts;
mod h2serve;
pub mod load;
pub mod relay;
pub mod runtime;
pub mod services;
pub mod splice;
pub mod stream_idle;
pub mod strict;
pub mod table;
pub mod tcp;
pub mod trace;
pub mod traffic;
pub use ebb_core::scaler::{BackendMiss, retry_after_miss};
pub use ebb_core::waiting;
/// The HTTP/1.x framing (heads, chunked bodies, request ids): its own crate, `ebb_http`.
pub use ebb_http::{chunked, head, request_id};

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::clock::Clock;
use crate::event::{Event, RouteSpec};
use crate::log::Log;
use crate::scaler::{awake_replicas, decide_wake, warm_min};
use crate::state::State;
use backends::{Backends, Slot};
use ebb_core::orchestrator::Orchestrator;
pub use h2hop::connections as h2c_connections;
use opentelemetry::trace::TraceContextExt as _;
use table::{Entry, Table};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
pub use traffic::{InFlight, RouteTraffic, Traffic};

/// Bodies the proxy sends and answers with.
pub type Body = BoxBody<Bytes, BoxError>;

/// A body's error: hyper's, or the proxy's own (a stream cut for idleness).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The proxy's TLS acceptor (its certificate is read again when its files change).
#[derive(Clone)]
pub struct Tls(pub tokio_rustls::TlsAcceptor);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

/// Tuning of the proxy. Every bound is a named value.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Idle keep-alive connections kept per backend.
    pub pool_max_idle_per_host: usize,
    /// How long an idle backend connection is kept.
    pub pool_idle_timeout_ms: u64,
    /// `Retry-After` seconds on 503s.
    pub retry_after_s: u32,
    /// How long a client connection may sit between requests (or inside a request head).
    pub client_idle_timeout_ms: u64,
    /// How long a request under way may go without a byte moving either way (the backend
    /// thinking included) before both connections are closed.
    pub request_stall_timeout_ms: u64,
    /// How long getting a connection to a backend may take in all (waiting for a free opening
    /// and every attempt).
    pub connect_timeout_ms: u64,
    /// How long one connect attempt may go unanswered before it is made again (doubling up to a
    /// second): a SYN dropped by a full accept queue is sent again now, not after the kernel's
    /// back-off.
    pub connect_attempt_ms: u64,
    /// Meta services served on their domains (`[[service]]` in `ebb.toml`).
    pub services: Vec<crate::discovery::meta::MetaService>,
    /// What resolves their destinations (DNS, Kubernetes); none: only fixed addresses and
    /// `ebb://` destinations have instances.
    pub discovery: Option<Arc<crate::discovery::Cache>>,
    /// At shutdown: how long requests under way and held requests may take to be answered once
    /// ebb stops accepting connections; past it, the rest are cut.
    pub drain_timeout_ms: u64,
    /// Bounds on what clients send and hold.
    pub limits: crate::limits::Limits,
    /// Serve TLS with this (`--tls-cert`, `--tls-key`); none: plain HTTP.
    pub tls: Option<Tls>,
    /// Threads relaying TCP routes' bytes through io_uring ([`relay`]); 0: the proxy threads
    /// copy them ([`splice::splice_tcp`]), as they do where the kernel refuses io_uring.
    pub tcp_relay_threads: usize,
}

impl Default for ProxyOptions {
    fn default() -> Self {
        Self {
            pool_max_idle_per_host: 256,
            pool_idle_timeout_ms: 90_000,
            retry_after_s: 1,
            client_idle_timeout_ms: 75_000,
            request_stall_timeout_ms: 300_000,
            connect_timeout_ms: 5_000,
            connect_attempt_ms: 50,
            services: Vec::new(),
            discovery: None,
            drain_timeout_ms: 30_000,
            limits: crate::limits::Limits::default(),
            tls: None,
            tcp_relay_threads: 1,
        }
    }
}

/// The proxy's shared state.
pub struct Proxy {
    log: Arc<Log>,
    orch: Arc<dyn Orchestrator>,
    clock: Arc<dyn Clock>,
    traffic: Arc<Traffic>,
    backends: Arc<Backends>,
    orch_version: tokio::sync::watch::Receiver<u64>,
    services: services::Services,
    /// What the Gateway API's sockets serve ([`gateway`]), swapped whole.
    gateway: std::sync::RwLock<Arc<gateway::Served>>,
    options: ProxyOptions,
    /// Client connections open now, across the proxy's threads (`--max-connections`).
    connections: Arc<std::sync::atomic::AtomicUsize>,
    /// Requests held now, across routes (`--max-held`).
    held: std::sync::atomic::AtomicU64,
    /// Set once shutdown begins: answers say `Connection: close` (HTTP/1.1) or the connection
    /// sends GOAWAY (HTTP/2), and idle connections close at once.
    draining: tokio::sync::watch::Sender<bool>,
    /// Open tunnels (upgraded connections, TCP routes), across the proxy's threads: a shutdown
    /// waits for them [`TUNNEL_DRAIN`] at most.
    tunnels: Arc<std::sync::atomic::AtomicU64>,
    /// The runtimes of the proxy's threads ([`Proxy::spawn_workers`]): TCP routes accept on
    /// each of them too.
    workers: std::sync::OnceLock<Vec<tokio::runtime::Handle>>,
    /// The TCP relay threads, started by the first TCP route connection; none when not asked
    /// for or when the kernel refused io_uring.
    relays: std::sync::OnceLock<Option<relay::Relays>>,
}

/// `n` listeners on one address with `SO_REUSEPORT`; the first one picks the port when it is 0.
///
/// A port named outright is first bound alone, without `SO_REUSEPORT`, and let go: a
/// `SO_REUSEPORT` bind succeeds on a port that any other process of the same user holds with
/// `SO_REUSEPORT` too (another ebb, nginx), and the kernel would then split that port's
/// connections between the two. The bind alone fails there as on any port in use, so the start
/// stops with `address in use` instead.
pub fn reuseport_listeners(
    addr: SocketAddr,
    n: usize,
) -> std::io::Result<Vec<std::net::TcpListener>> {
    if addr.port() != 0 {
        drop(std::net::TcpListener::bind(addr)?);
    }
    let mut addr = addr;
    let mut out = Vec::new();
    for i in 0..n.max(1) {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.bind(addr)?;
        let listener = socket.listen(1024)?;
        if i == 0 {
            addr = listener.local_addr()?;
        }
        out.push(listener.into_std()?);
    }
    Ok(out)
}

/// How long a shutdown waits for open tunnels (WebSocket and other upgrades, TCP routes) once
/// no request is under way: they have no end of their own to wait for, so they are cut then.
pub const TUNNEL_DRAIN: Duration = Duration::from_secs(1);

/// One open tunnel, counted while it lives.
pub(crate) struct TunnelGuard(Arc<std::sync::atomic::AtomicU64>);

impl Drop for TunnelGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// One client connection counted against `--max-connections`.
struct ConnectionSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One request counted against `--max-held`.
struct HeldAll<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for HeldAll<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed()
}

fn json_error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({ "error": message, "code": code }).to_string();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("valid response")
}

/// [`json_error`], but to a HEAD request its head alone: no body, so no `Content-Type` that
/// promises one.
fn error_for(
    method: &hyper::Method,
    status: StatusCode,
    code: &str,
    message: &str,
) -> Response<Body> {
    if method == hyper::Method::HEAD {
        let mut r = Response::new(empty());
        *r.status_mut() = status;
        return r;
    }
    json_error(status, code, message)
}

/// A request the proxy answers itself, with a JSON error.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// Whether the answer carries `Retry-After`.
    retry_after: bool,
    /// A waiting page (HTML, and seconds between its reloads) instead of the JSON body.
    page: Option<(String, u32)>,
}

impl From<ebb_http::h1::Refused> for Refusal {
    fn from(r: ebb_http::h1::Refused) -> Self {
        Self::new(r.status, r.code, r.message)
    }
}

impl Refusal {
    fn new(status: StatusCode, code: &'static str, message: String) -> Self {
        Self {
            status,
            code,
            message,
            retry_after: false,
            page: None,
        }
    }

    /// A browser's cold request: 503 with the route's waiting page, which reloads itself.
    fn waiting(html: String, refresh_s: u32) -> Self {
        Self {
            page: Some((html, refresh_s)),
            ..Self::unavailable("waking", "the workload is waking up".into())
        }
    }

    /// 503 with `Retry-After`.
    fn unavailable(code: &'static str, message: String) -> Self {
        Self {
            retry_after: true,
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
        }
    }

    fn bad_gateway(message: String) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "backend_error", message)
    }

    /// The JSON body.
    fn json(&self) -> String {
        serde_json::json!({ "error": self.message, "code": self.code }).to_string()
    }

    /// The answer to a gRPC call (`UNAVAILABLE` with the message) or, to any other request,
    /// [`Refusal::into_response`].
    fn answer(self, grpc: bool, retry_after_s: u32) -> Response<Body> {
        if grpc {
            grpc::status(grpc::UNAVAILABLE, &self.message)
        } else {
            self.into_response(retry_after_s)
        }
    }

    fn into_response(self, retry_after_s: u32) -> Response<Body> {
        let mut r = match self.page {
            None => json_error(self.status, self.code, &self.message),
            Some((html, refresh_s)) => {
                let mut r =
                    Response::new(Full::new(Bytes::from(html)).map_err(|e| match e {}).boxed());
                *r.status_mut() = self.status;
                let h = r.headers_mut();
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/html; charset=utf-8"),
                );
                h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                h.insert(
                    HeaderName::from_static("refresh"),
                    HeaderValue::from(refresh_s),
                );
                r
            }
        };
        if self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
        }
        r
    }
}

/// Headers that belong to one connection, never forwarded (RFC 9110 section 7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        for n in named {
            headers.remove(n);
        }
    }
    for n in &HOP_BY_HOP {
        headers.remove(n);
    }
}

/// Resolves `ms` milliseconds after it is first polled; never when `ms` is 0 (no bound). A timer
/// made only when there is a bound: `select!` evaluates a branch's future even when its
/// precondition is false, and a `tokio::time::sleep` made per request for nothing (a look up of
/// the runtime's handle and the clock) was 1.5 % of ebb's CPU under h2c load.
async fn response_bound(ms: u64) {
    if ms == 0 {
        return std::future::pending().await;
    }
    tokio::time::sleep(Duration::from_millis(ms)).await
}

/// A request's hash key under `policy` (for consistent hashing).
fn key_of(
    policy: &crate::discovery::Policy,
    target: &str,
    headers: &HeaderMap,
    peer: SocketAddr,
) -> Option<u64> {
    policy.hash_on.as_ref().and_then(|h| {
        crate::discovery::request_key(
            h,
            target,
            |n| headers.get(n).map(|v| v.as_bytes()),
            peer.ip(),
        )
    })
}

/// The request as sent to the instance at `addr`: the client's parts, `body`, and a URI of the
/// instance's authority and `path`. `Err`: why that is not a URI.
fn to_backend(
    mut parts: hyper::http::request::Parts,
    body: Body,
    addr: SocketAddr,
    path: &hyper::http::uri::PathAndQuery,
) -> Result<Request<Body>, String> {
    let mut uri = hyper::http::uri::Parts::default();
    uri.scheme = Some(hyper::http::uri::Scheme::HTTP);
    uri.authority = Some(authority(addr));
    uri.path_and_query = Some(path.clone());
    parts.uri = Uri::from_parts(uri).map_err(|e| e.to_string())?;
    Ok(Request::from_parts(parts, body))
}

/// Applies a meta route's header changes.
fn change_headers(headers: &mut HeaderMap, changes: &crate::discovery::meta::Changes) {
    for n in &changes.remove {
        headers.remove(n.as_str());
    }
    for (n, v) in &changes.set {
        if let (Ok(n), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.insert(n, v);
        }
    }
    for (n, v) in &changes.add {
        if let (Ok(n), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.append(n, v);
        }
    }
}

/// A response body that keeps its request counted as in flight, and its slot on the replica,
/// until it is done.
struct Counted {
    inner: Body,
    /// A workload route's request (a meta service's are not counted).
    _in_flight: Option<InFlight>,
    _slot: Slot,
}

impl HttpBody for Counted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Proxy {
    /// A proxy over the live route store and an orchestrator.
    pub fn new(
        log: Arc<Log>,
        orch: Arc<dyn Orchestrator>,
        clock: Arc<dyn Clock>,
        traffic: Arc<Traffic>,
        options: ProxyOptions,
    ) -> Self {
        let orch_version = orch.changes();
        let backends = Arc::new(Backends::default());
        let services =
            services::Services::build(&options.services, &backends, options.discovery.as_deref());
        Self {
            log,
            orch,
            clock,
            traffic,
            backends,
            orch_version,
            services,
            gateway: std::sync::RwLock::default(),
            options,
            connections: Arc::default(),
            held: std::sync::atomic::AtomicU64::new(0),
            draining: tokio::sync::watch::channel(false).0,
            tunnels: Arc::default(),
            workers: std::sync::OnceLock::new(),
            relays: std::sync::OnceLock::new(),
        }
    }

    /// The TCP relay threads ([`relay`]), started the first time they are asked for; none
    /// when `tcp_relay_threads` is 0 or io_uring cannot be had (then said once in the log).
    pub(crate) fn relays(&self) -> Option<&relay::Relays> {
        self.relays
            .get_or_init(|| {
                let threads = self.options.tcp_relay_threads;
                if threads == 0 {
                    return None;
                }
                match relay::Relays::start(threads, self.clock.clone()) {
                    Ok(relays) => {
                        tracing::info!(threads, "TCP routes relay through io_uring");
                        Some(relays)
                    }
                    // Refused outright (a seccomp profile, `kernel.io_uring_disabled`, an old
                    // kernel) is how many containers run: said, not warned of.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOSYS)) => {
                        tracing::info!(error = %e, "io_uring refused: TCP routes copy on the proxy threads");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring cannot be had: TCP routes copy on the proxy threads");
                        None
                    }
                }
            })
            .as_ref()
    }

    /// The runtimes that serve connections: the proxy's threads once they run, else (a proxy
    /// whose threads were never spawned, in tests) the caller's.
    fn worker_runtimes(&self) -> Vec<tokio::runtime::Handle> {
        match self.workers.get() {
            Some(w) if !w.is_empty() => w.clone(),
            _ => vec![tokio::runtime::Handle::current()],
        }
    }

    /// `SO_REUSEPORT` listeners on `addr`, one per proxy thread ([`reuseport_listeners`]).
    pub(crate) fn listeners_for_workers(
        &self,
        addr: SocketAddr,
    ) -> std::io::Result<Vec<std::net::TcpListener>> {
        reuseport_listeners(addr, self.worker_runtimes().len())
    }

    /// Runs `accept` on each of `listeners`, each on a proxy thread of its own (TCP routes and
    /// Gateway sockets, as [`Proxy::spawn_workers`] does for the proxy's port); `what` names
    /// them in the log when one cannot be used.
    pub(crate) fn accept_on_workers<F, Fut>(
        &self,
        listeners: Vec<std::net::TcpListener>,
        what: &str,
        accept: F,
    ) -> Vec<tokio::task::JoinHandle<()>>
    where
        F: Fn(tokio::net::TcpListener) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let runtimes = self.worker_runtimes();
        listeners
            .into_iter()
            .zip(runtimes.iter().cycle())
            .map(|(listener, rt)| {
                // Made a tokio listener inside its runtime, which registers it there.
                let _in = rt.enter();
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => rt.spawn(accept(l)),
                    Err(e) => {
                        tracing::warn!(what, error = %e, "listener unusable");
                        rt.spawn(async {})
                    }
                }
            })
            .collect()
    }

    /// Requests under way on the replica at `addr`: a replica being scaled down is stopped once
    /// this is 0.
    pub fn in_flight_at(&self, addr: std::net::SocketAddr) -> u32 {
        self.backends.in_flight_at(addr)
    }

    /// Every replica with requests under way through this ebb, and how many.
    pub fn busy_replicas(&self) -> std::collections::BTreeMap<std::net::SocketAddr, u32> {
        self.backends.busy_replicas()
    }

    /// Begins the shutdown's drain: answers from now on close their connections, idle ones
    /// close at once.
    pub fn start_draining(&self) {
        self.draining.send_replace(true);
    }

    /// Whether the shutdown's drain has begun.
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Resolves once the shutdown's drain has begun.
    pub(crate) async fn drained(&self) {
        let mut rx = self.draining.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// Counts an open tunnel until the guard is dropped.
    pub(crate) fn tunnel_guard(&self) -> TunnelGuard {
        self.tunnels
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        TunnelGuard(self.tunnels.clone())
    }

    /// The route a Host leads to ([`Proxy::table`]).
    fn route(&self, host: &str) -> Option<Arc<Entry>> {
        self.table().lookup(host)
    }

    /// The routing table, rebuilt first if the route store has changed since it was built. Each
    /// thread builds and keeps a table of its own, with the log's applied seq it last checked it
    /// at: while the log has not moved, no lock is taken, and the reference counts of the table,
    /// its entries and their cached replica lists are the thread's alone. (One table shared by
    /// the proxy threads had each request count on the same cache lines from every core.)
    fn table(&self) -> Arc<Table> {
        thread_local! {
            static CACHED: std::cell::RefCell<Option<(usize, u64, Arc<Table>)>> =
                const { std::cell::RefCell::new(None) };
        }
        let me = self as *const Self as usize;
        let applied = self.log.applied_seq();
        CACHED.with(|c| {
            let mut c = c.borrow_mut();
            if let Some((p, seen, t)) = c.as_mut()
                && *p == me
            {
                if *seen == applied {
                    return t.clone();
                }
                if t.seq == self.log.read(|s| s.routes.changed_at_seq) {
                    *seen = applied;
                    return t.clone();
                }
            }
            let fresh = Arc::new(
                self.log
                    .read(|s| Table::build(s, &self.traffic, &self.backends)),
            );
            *c = Some((me, applied, fresh.clone()));
            fresh
        })
    }

    /// The proxy's clock behind an `Arc` of this thread's own: a request's clone and drop of it
    /// count on the thread's cache line, not on the one every proxy thread would share.
    fn thread_clock(&self) -> Arc<dyn Clock> {
        /// Reads the clock it wraps.
        struct Local(Arc<dyn Clock>);
        impl Clock for Local {
            fn now_ms(&self) -> u64 {
                self.0.now_ms()
            }
        }
        thread_local! {
            static LOCAL: std::cell::RefCell<Option<(usize, Arc<dyn Clock>)>> =
                const { std::cell::RefCell::new(None) };
        }
        let me = Arc::as_ptr(&self.clock).cast::<()>() as usize;
        LOCAL.with(|l| {
            let mut l = l.borrow_mut();
            match l.as_ref() {
                Some((of, local)) if *of == me => local.clone(),
                _ => {
                    let local: Arc<dyn Clock> = Arc::new(Local(self.clock.clone()));
                    *l = Some((me, local.clone()));
                    local
                }
            }
        })
    }

    /// Serves each listener on a thread of its own with a single-threaded runtime, the way nginx
    /// runs worker processes: listeners bound with `SO_REUSEPORT` to one address share the
    /// connections, and each thread keeps its connections, tasks and backend pool to itself.
    /// The threads' runtimes are kept: TCP routes accept on them too ([`tcp::run`]).
    pub fn spawn_workers(
        self: &Arc<Self>,
        listeners: Vec<std::net::TcpListener>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        let mut threads = Vec::new();
        let mut handles = Vec::new();
        for (i, listener) in listeners.into_iter().enumerate() {
            let proxy = self.clone();
            let mut stop = stop.clone();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(rt.handle().clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("ebb-proxy-{i}"))
                    .spawn(move || {
                        rt.block_on(async move {
                            let listener = match tokio::net::TcpListener::from_std(listener) {
                                Ok(l) => l,
                                Err(e) => {
                                    tracing::error!(error = %e, "proxy listener unusable");
                                    return;
                                }
                            };
                            proxy
                                .clone()
                                .serve(listener, async move {
                                    let _ = stop.changed().await;
                                })
                                .await;
                            // The thread's connections go on until their requests are answered;
                            // from now on they close after their answer.
                            proxy.start_draining();
                            proxy.drain().await;
                        });
                    })?,
            );
        }
        let _ = self.workers.set(handles);
        Ok(threads)
    }

    /// Requests under way on every route (held ones and open WebSocket tunnels included).
    pub fn busy(&self) -> u64 {
        self.traffic.all().iter().map(|(_, t)| t.in_flight()).sum()
    }

    /// Waits until no request is under way or held, for at most the drain timeout, and for
    /// open tunnels [`TUNNEL_DRAIN`] at most (they are cut when the proxy's threads end).
    pub async fn drain(&self) {
        let limit = Duration::from_millis(self.options.drain_timeout_ms);
        let watch = crate::clock::Stopwatch::start();
        loop {
            let busy = self.busy();
            let tunnels = self.tunnels.load(std::sync::atomic::Ordering::Acquire);
            if busy <= tunnels && (tunnels == 0 || watch.elapsed() >= TUNNEL_DRAIN.min(limit)) {
                if tunnels > 0 {
                    tracing::info!(
                        tunnels,
                        "shutting down: open tunnels (WebSocket, TCP) are cut"
                    );
                }
                return;
            }
            if watch.elapsed() >= limit {
                tracing::warn!(
                    requests = busy,
                    drain_timeout_ms = self.options.drain_timeout_ms,
                    "shutting down with requests still under way: they are cut"
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Accepts connections until `shutdown` resolves.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors, most likely: try again a moment later rather
                        // than at once, which would spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = &mut shutdown => return,
            };
            let _ = stream.set_nodelay(true);
            let Some(counted) = self.connection_slot() else {
                tokio::spawn(h1::refuse_connection(self.clone(), stream));
                continue;
            };
            let proxy = self.clone();
            match self.options.tls.clone() {
                None => {
                    tokio::spawn(async move {
                        h1::serve_connection(proxy, stream, peer, None).await;
                        drop(counted);
                    });
                }
                // Over TLS every request takes the general path (hyper: HTTP/1.1 and h2 by ALPN).
                Some(acceptor) => {
                    let limit = Duration::from_millis(self.options.limits.header_read_timeout_ms);
                    tokio::spawn(async move {
                        match tokio::time::timeout(limit, acceptor.0.accept(stream)).await {
                            Ok(Ok(tls)) => proxy.serve_hyper(tls, peer, true, None).await,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed")
                            }
                            Err(_) => {
                                crate::limits::Limit::HeaderReadTimeout.hit();
                                tracing::debug!(%peer, "TLS handshake timed out");
                            }
                        }
                        drop(counted);
                    });
                }
            }
        }
    }

    /// A connection counted against `--max-connections`, or `None` past it.
    fn connection_slot(&self) -> Option<ConnectionSlot> {
        let max = self.options.limits.max_connections;
        if self
            .connections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            >= max
        {
            self.connections
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            crate::limits::Limit::Connections.hit();
            return None;
        }
        Some(ConnectionSlot(self.connections.clone()))
    }

    /// An h2c connection with prior knowledge, on ebb's own HTTP/2 server side ([`h2serve`]):
    /// `read`, what the HTTP/1.1 path read of it (the preface's start at least). `gateway`: the
    /// plain Gateway socket it came in on.
    async fn serve_h2c(
        self: Arc<Self>,
        client: tokio::net::TcpStream,
        read: bytes::BytesMut,
        peer: SocketAddr,
        gateway: Option<SocketAddr>,
    ) {
        h2serve::serve(self, client, read, peer, gateway).await
    }

    /// [`Proxy::serve_hyper`] for a plain connection: the proxy's own port's, or a plain Gateway
    /// socket's (`gateway`, its address). The HTTP/1.1 path hands connections here when a
    /// request needs more than it does.
    async fn serve_hyper_plain<I>(
        self: Arc<Self>,
        io: I,
        peer: SocketAddr,
        gateway: Option<SocketAddr>,
    ) where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let socket = gateway.map(|addr| gateway::Socket { addr, sni: None });
        self.serve_hyper(io, peer, false, socket).await
    }

    /// Serves a connection with hyper: HTTP/1.0 and 1.1, h2c, upgrades. `gateway`: the Gateway
    /// socket it came in on, whose routes it takes.
    async fn serve_hyper<I>(
        self: Arc<Self>,
        io: I,
        peer: SocketAddr,
        https: bool,
        gateway: Option<gateway::Socket>,
    ) where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let limits = self.options.limits;
        let draining = self.clone();
        let proxy = self;
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let proxy = proxy.clone();
            let mut req = req.map(|b| b.map_err(BoxError::from).boxed());
            if https {
                req.extensions_mut().insert(Https);
            }
            if let Some(socket) = &gateway {
                req.extensions_mut().insert(socket.clone());
            }
            async move { Ok::<_, std::convert::Infallible>(proxy.answer(req, peer).await) }
        });

        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(Duration::from_millis(limits.header_read_timeout_ms))
            .max_buf_size(limits.max_head_bytes.max(8 * 1024));
        builder
            .http2()
            .timer(hyper_util::rt::TokioTimer::new())
            .max_header_list_size(u32::try_from(limits.max_head_bytes).unwrap_or(u32::MAX));
        // The HTTP/1.1 path's refusal of a lone LF holds here too.
        let io = strict::Strict::for_proxy(io)
            .first_within(Duration::from_millis(limits.header_read_timeout_ms));
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
        tokio::pin!(conn);
        // Once draining: HTTP/1 answers with `Connection: close` (an idle connection closes at
        // once), HTTP/2 sends GOAWAY and ends after the streams under way.
        let ended = tokio::select! {
            r = conn.as_mut() => r,
            () = draining.drained() => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = ended {
            tracing::debug!(error = %e, %peer, "connection ended with an error");
        }
    }

    /// Answers one request as a connection's server hands it over (hyper's, or the HTTP/2
    /// driver's): the lone-LF refusal, its span when tracing is on, then [`Proxy::handle`].
    pub(crate) async fn answer(&self, mut req: Request<Body>, peer: SocketAddr) -> Response<Body> {
        if strict::is_refusal(req.headers()) {
            // A head with a lone LF, refused as the HTTP/1.1 path refuses it.
            let mut r = json_error(StatusCode::BAD_REQUEST, "bad_request", strict::LONE_LF);
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
        // Boxed: an HTTP/2 stream's task holds this future, moved whole into the task and
        // out at its end; the boxed one is a pointer.
        let Some(tracing) = trace::tracing() else {
            return Box::pin(self.handle(req, peer)).await;
        };
        // Traced: the request's span from its head to its answer's head, its context
        // sent on in place of the client's.
        let cx = {
            let host = routed_by(&req).map(|(h, _)| h).unwrap_or_default();
            let method = req.method().as_str().to_owned();
            let path = req.uri().path().to_owned();
            tracing.request(
                &trace::Reading(req.headers()),
                trace::RequestSpan {
                    method: &method,
                    path: &path,
                    host: &host,
                    route: None,
                    client: Some(peer),
                    request_id: None,
                },
            )
        };
        let grpc = grpc::is_grpc_request(&req);
        if let Some(cx) = &cx {
            if grpc {
                trace::rpc(cx, req.uri().path());
            }
            tracing.inject(cx, &mut trace::Headers(req.headers_mut()));
            req.extensions_mut().insert(trace::RequestCx(cx.clone()));
        }
        let resp = Box::pin(self.handle(req, peer)).await;
        if let Some(cx) = cx {
            if grpc {
                // A status in the head (a trailers-only answer: ebb's own, or an
                // error); one in the trailers comes after the span ends.
                trace::grpc_status(&cx, resp.headers().get("grpc-status"));
            }
            trace::answered(cx, resp.status().as_u16());
        }
        resp
    }

    /// Answers one request.
    pub async fn handle(&self, mut req: Request<Body>, peer: SocketAddr) -> Response<Body> {
        let (host, path) = match routed_by(&req) {
            Ok(t) => t,
            Err(e) => {
                let mut r = json_error(e.status(), e.code(), e.message());
                if e.closes() {
                    r.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                return r;
            }
        };
        if let Some(socket) = req.extensions().get::<gateway::Socket>().cloned() {
            let entry = self.gateway_socket(socket.addr);
            let bare = crate::ids::authority(&host);
            if let (Some(entry), Some(sni)) = (&entry, &socket.sni)
                && entry.misdirected(sni, &bare)
            {
                return error_for(
                    req.method(),
                    StatusCode::MISDIRECTED_REQUEST,
                    "misdirected_request",
                    &format!(
                        "the host {bare:?} is another listener's than the TLS server name {sni:?}'s"
                    ),
                );
            }
            let service = entry.and_then(|s| s.lookup(&host));
            return match service {
                Some(service) => {
                    Box::pin(self.handle_service(req, peer, host, path, service)).await
                }
                None if grpc::is_grpc_request(&req) => grpc::status(
                    grpc::UNIMPLEMENTED,
                    &format!(
                        "no route of the Gateway listener {} for host {host:?}",
                        socket.addr
                    ),
                ),
                None => error_for(
                    req.method(),
                    StatusCode::NOT_FOUND,
                    "unknown_host",
                    &format!(
                        "no route of the Gateway listener {} for host {host:?}",
                        socket.addr
                    ),
                ),
            };
        }
        if let Some(service) = self.services.lookup(&host) {
            return Box::pin(self.handle_service(req, peer, host, path, service)).await;
        }
        let Some(entry) = self.route(&host) else {
            return json_error(
                StatusCode::NOT_FOUND,
                "unknown_host",
                &format!("no route for host {host:?}"),
            );
        };
        let route = &entry.spec;
        let in_flight = entry.traffic.begin(self.clock.now_ms());
        // Sent again only without a body: an HTTP/2 request's body need not be announced by a
        // length (a gRPC call's seldom is), so the body says, not the head.
        let replayable = req.body().is_end_stream();
        // An upgrade (WebSocket) keeps its Upgrade header and becomes a byte tunnel after a 101.
        let upgrade_to = upgrade_protocol(req.headers());
        let client_upgrade = upgrade_to.is_some().then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let grpc = grpc::is_grpc(&parts);
        strip_hop_by_hop(&mut parts.headers);
        // The Host the request was routed by (the target's authority, when it had one).
        match HeaderValue::from_str(&host) {
            Ok(h) => {
                parts.headers.insert(header::HOST, h);
            }
            Err(_) => return json_error(StatusCode::BAD_REQUEST, "bad_host", "invalid Host"),
        }
        if grpc {
            // gRPC goes on over HTTP/2 (h2c to the replica), with its trailers, and the routed
            // host as `:authority`'s stand-in in `Host`.
            parts.version = hyper::Version::HTTP_2;
            parts
                .headers
                .insert(header::TE, HeaderValue::from_static("trailers"));
        } else {
            // Backends speak HTTP/1.1 whatever the client spoke (h2c included), with the
            // client's Host.
            parts.version = hyper::Version::HTTP_11;
        }
        if let Some(proto) = &upgrade_to {
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            parts.headers.insert(header::UPGRADE, proto.clone());
        }
        let https = parts.extensions.get::<Https>().is_some();
        add_forwarded(&mut parts.headers, peer, &host, https);
        let id = ensure_request_id(&mut parts.headers);
        let span = parts
            .extensions
            .get::<trace::RequestCx>()
            .map(|c| c.0.clone());
        trace::routed(span.as_ref(), &route.name, id.as_bytes());
        let key = key_of(&route.policy, &path, &parts.headers, peer);
        let wants_page = route.waiting_page.is_some()
            && upgrade_to.is_none()
            && waiting::wanted(
                parts.method.as_str().as_bytes(),
                parts.headers.get(header::ACCEPT).map(|v| v.as_bytes()),
            );
        let path = match hyper::http::uri::PathAndQuery::try_from(path.as_str()) {
            Ok(p) => p,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, "bad_target", &e.to_string()),
        };
        // The stream-idle bound: frames of either body mark it, from a replica being found on.
        let stall_ms = match route.stream_idle_timeout_ms {
            0 => self.options.request_stall_timeout_ms,
            ms => ms,
        };
        let progress = stream_idle::Progress::new(self.thread_clock(), stall_ms);
        let mut body = Some(
            stream_idle::Marking {
                inner: body,
                progress: progress.clone(),
            }
            .boxed(),
        );
        // A gRPC call's deadline bounds its wait for a replica too.
        let deadline = grpc.then(|| grpc::timeout(&parts.headers)).flatten();
        // A replica that refused or reset the connection is avoided on the retry.
        let mut failed: Option<SocketAddr> = None;
        let mut parts = Some(parts);
        loop {
            let endpoint = self.endpoint(
                &entry,
                failed,
                key,
                id.as_bytes(),
                wants_page,
                span.as_ref(),
            );
            let found = match deadline {
                None => endpoint.await,
                Some(d) => match tokio::time::timeout(d, endpoint).await {
                    Ok(found) => found,
                    Err(_) => {
                        entry.traffic.answered(200, None);
                        return grpc::status(
                            grpc::DEADLINE_EXCEEDED,
                            &format!(
                                "no replica of {} was ready within the call's deadline",
                                route.name
                            ),
                        );
                    }
                },
            };
            let slot = match found {
                Ok(s) => s,
                Err(refusal) => {
                    entry.traffic.answered(refusal.status.as_u16(), None);
                    return refusal.answer(grpc, self.options.retry_after_s);
                }
            };
            let addr = slot.addr();
            trace::replica(span.as_ref(), addr);
            let Some(head) = parts.take() else {
                return json_error(
                    StatusCode::BAD_GATEWAY,
                    "backend_error",
                    "the request cannot be sent again",
                );
            };
            let out = match to_backend(head, body.take().unwrap_or_else(empty), addr, &path) {
                Ok(r) => keep_head(r, &mut parts, grpc, replayable, failed.is_some()),
                Err(e) => return json_error(StatusCode::BAD_REQUEST, "bad_request", &e),
            };
            progress.mark_now();
            // Boxed, as the wait for a replica is: every request's state would carry the
            // send's otherwise, and be copied whole at its start.
            let sent = Box::pin(self.send(grpc, addr, out));
            // Until the answer's head, the stream-idle bound holds too, and the route's
            // response timeout when it has one.
            let ms = route.response_timeout_ms;
            let answered = tokio::select! {
                biased;
                r = sent => Ok(r),
                () = progress.stalled() => Err(None),
                () = response_bound(ms) => Err(Some(ms)),
            };
            let answered = match answered {
                Ok(r) => r,
                Err(None) => {
                    entry.traffic.timed_out(traffic::Timeout::StreamIdle);
                    entry.traffic.answered(504, None);
                    let message = format!(
                        "the request moved no byte either way for {stall_ms} ms (stream_idle_timeout_ms)"
                    );
                    if grpc {
                        return grpc::status(grpc::DEADLINE_EXCEEDED, &message);
                    }
                    return json_error(
                        StatusCode::GATEWAY_TIMEOUT,
                        "stream_idle_timeout",
                        &message,
                    );
                }
                Err(Some(ms)) => {
                    entry.traffic.timed_out(traffic::Timeout::Response);
                    entry.traffic.answered(504, None);
                    if grpc {
                        return grpc::status(
                            grpc::DEADLINE_EXCEEDED,
                            &format!("the replica did not begin its answer within {ms} ms"),
                        );
                    }
                    return json_error(
                        StatusCode::GATEWAY_TIMEOUT,
                        "response_timeout",
                        &format!(
                            "the replica did not begin its answer within {ms} ms (response_timeout_ms)"
                        ),
                    );
                }
            };
            match answered {
                Ok(mut resp) => {
                    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
                        let load = resp
                            .headers()
                            .get("x-runner-load")
                            .and_then(|v| crate::discovery::parse_load(v.as_bytes()));
                        let rtt_us = slot.answered(resp.status().as_u16(), load);
                        entry.traffic.answered(resp.status().as_u16(), Some(rtt_us));
                        if let Some(cx) = &span {
                            trace::exemplar(&entry.traffic, rtt_us, cx, self.clock.now_ms());
                        }
                    } else {
                        entry.traffic.answered(101, None);
                    }
                    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
                        && let Some(client_upgrade) = client_upgrade
                    {
                        let backend_upgrade = hyper::upgrade::on(&mut resp);
                        let idle = (route.connection_idle_timeout_ms > 0)
                            .then(|| Duration::from_millis(route.connection_idle_timeout_ms));
                        tokio::spawn(tunnel(
                            client_upgrade,
                            backend_upgrade,
                            (in_flight, slot, self.tunnel_guard()),
                            idle,
                            Some(entry.traffic.clone()),
                            self.clock.clone(),
                        ));
                        let (parts, _) = resp.into_parts();
                        return Response::from_parts(parts, empty());
                    }
                    let (mut parts, body) = resp.into_parts();
                    strip_hop_by_hop(&mut parts.headers);
                    let counts = entry.traffic.clone();
                    let bounded = stream_idle::Bounded::new(
                        body,
                        progress.clone(),
                        Box::new(move || counts.timed_out(traffic::Timeout::StreamIdle)),
                    );
                    let body = Counted {
                        inner: bounded.boxed(),
                        _in_flight: Some(in_flight),
                        _slot: slot,
                    };
                    return Response::from_parts(parts, body.boxed());
                }
                Err(mut e) => {
                    slot.failed();
                    // The replica is stopping or gone: wake the workload again and try once more,
                    // on another replica.
                    if let Some(again) = try_again(&mut e, replayable, failed.is_some()) {
                        again.restore(&mut e, &mut parts, &mut body);
                        tracing::debug!(route = %route.name, %addr, error = %e, "backend went away; retrying");
                        failed = Some(addr);
                        continue;
                    }
                    entry.traffic.answered(502, None);
                    if grpc {
                        return grpc::status(grpc::UNAVAILABLE, &format!("backend {addr}: {e}"));
                    }
                    return json_error(
                        StatusCode::BAD_GATEWAY,
                        "backend_error",
                        &format!("backend {addr}: {e}"),
                    );
                }
            }
        }
    }

    /// A request for a meta service: its first matching route rewrites it, a destination is
    /// drawn by weight, the destination's policy picks an instance; a refused or reset
    /// connection is tried once more on another instance when the request can be sent again.
    async fn handle_service(
        &self,
        mut req: Request<Body>,
        peer: SocketAddr,
        host: String,
        target: String,
        service: Arc<services::ServiceEntry>,
    ) -> Response<Body> {
        // An upgrade (WebSocket) keeps its Upgrade header and becomes a byte tunnel after a 101.
        let upgrade_to = upgrade_protocol(req.headers());
        let mut client_upgrade = upgrade_to.is_some().then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        // A gRPC call goes on over h2c, and what ebb answers itself is a gRPC status.
        let grpc = grpc::is_grpc(&parts);
        let refuse = |status: StatusCode, code: &str, message: &str| {
            if grpc {
                grpc::status(grpc::UNAVAILABLE, message)
            } else {
                json_error(status, code, message)
            }
        };
        let bare_host = crate::ids::authority(&host);
        let matched = {
            let headers = &parts.headers;
            let header = |n: &str| headers.get(n).map(|v| v.as_bytes());
            service.meta.route(&crate::discovery::meta::RequestView {
                authority: &bare_host,
                method: parts.method.as_str(),
                target: &target,
                header: &header,
            })
        };
        let Some((ri, sent)) = matched else {
            if grpc {
                return grpc::status(
                    grpc::UNIMPLEMENTED,
                    &format!("no route of {} matches {target}", service.meta.id),
                );
            }
            return error_for(
                &parts.method,
                StatusCode::NOT_FOUND,
                "no_matching_route",
                &format!(
                    "no route of {} matches {} {target}",
                    service.meta.id, parts.method
                ),
            );
        };
        let route = &service.meta.routes[ri];
        if let Some(why) = &route.fail {
            return refuse(StatusCode::INTERNAL_SERVER_ERROR, "rule_failed", why);
        }
        let https = parts.extensions.get::<Https>().is_some();
        if route.redirect.is_some() {
            let port = parts
                .extensions
                .get::<gateway::Socket>()
                .map_or(if https { 443 } else { 80 }, |s| s.addr.port());
            let scheme = if https { "https" } else { "http" };
            let status = route.redirect.as_ref().map_or(302, |r| r.status);
            let location = route.location(scheme, &bare_host, port, &target);
            let mut r = Response::new(empty());
            *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::FOUND);
            if let Some(l) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
                r.headers_mut().insert(header::LOCATION, l);
            }
            return r;
        }
        if route.total_weight() == 0 {
            return refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "no_backend",
                "every backend of the rule has weight 0",
            );
        }
        let di = services::draw(route);
        let dest = &route.destinations[di];
        if let crate::discovery::meta::Source::Invalid(why) = &dest.source {
            return refuse(StatusCode::INTERNAL_SERVER_ERROR, "invalid_backend", why);
        }
        // As on a route's path: sent again only without a body.
        let replayable = body.is_end_stream();
        strip_hop_by_hop(&mut parts.headers);
        // gRPC, and every request to an h2c destination, goes on over HTTP/2.
        let h2 = grpc || dest.h2c;
        if h2 {
            parts.version = hyper::Version::HTTP_2;
        } else {
            parts.version = hyper::Version::HTTP_11;
        }
        if grpc {
            parts
                .headers
                .insert(header::TE, HeaderValue::from_static("trailers"));
        }
        if let Some(proto) = upgrade_to.as_ref().filter(|_| !h2) {
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            parts.headers.insert(header::UPGRADE, proto.clone());
        }
        let sent_host = route.rewrite_host.as_deref().unwrap_or(&host);
        if let Ok(h) = HeaderValue::from_str(sent_host) {
            parts.headers.insert(header::HOST, h);
        }
        change_headers(&mut parts.headers, &route.request_headers);
        change_headers(&mut parts.headers, &dest.request_headers);
        add_forwarded(&mut parts.headers, peer, &host, https);
        let id = ensure_request_id(&mut parts.headers);
        let span = parts
            .extensions
            .get::<trace::RequestCx>()
            .map(|c| c.0.clone());
        trace::routed(span.as_ref(), &service.meta.id, id.as_bytes());
        let key = key_of(&dest.policy, &target, &parts.headers, peer);
        let path = match hyper::http::uri::PathAndQuery::try_from(sent.as_str()) {
            Ok(p) => p,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, "bad_target", &e.to_string()),
        };
        let mut body = Some(body);
        let mut failed: Option<SocketAddr> = None;
        // An `ebb://app` destination is the app's traffic: counted as its requests (its idle
        // timer, the downscale's in-flight check), woken from zero and held as they are.
        let app = dest.app().and_then(|a| self.table().named(a));
        let mut in_flight = app.as_ref().map(|e| e.traffic.begin(self.clock.now_ms()));
        let ready = || self.service_ready(&service, ri, di);
        // Past the rule's request timeout (a wake, a wait and a retry included) or a gRPC call's
        // deadline: 504, or `DEADLINE_EXCEEDED`.
        let deadline_ms = grpc
            .then(|| grpc::timeout(&parts.headers))
            .flatten()
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
        let request_ms = match (route.request_timeout_ms, deadline_ms) {
            (0, d) => d.unwrap_or(0),
            (r, None) => r,
            (r, Some(d)) => r.min(d),
        };
        // The head, taken by each try and put back for the next ([`keep_head`]).
        let mut parts = Some(parts);
        let timed_out = |what: &str, code: &str, ms: u64| {
            if let Some(entry) = &app {
                entry.traffic.timed_out(traffic::Timeout::Response);
                entry.traffic.answered(504, None);
            }
            let message = format!("{what} {ms} ms");
            if grpc {
                grpc::status(grpc::DEADLINE_EXCEEDED, &message)
            } else {
                json_error(StatusCode::GATEWAY_TIMEOUT, code, &message)
            }
        };
        let tries = async {
            loop {
                let slot = match self
                    .service_slot(
                        &service,
                        ri,
                        di,
                        app.as_deref(),
                        failed,
                        key,
                        id.as_bytes(),
                        span.as_ref(),
                    )
                    .await
                {
                    Ok(slot) => slot,
                    Err(r) => {
                        if let Some(entry) = &app {
                            entry.traffic.answered(r.status.as_u16(), None);
                        }
                        return r.answer(grpc, self.options.retry_after_s);
                    }
                };
                let addr = slot.addr();
                trace::replica(span.as_ref(), addr);
                let Some(head) = parts.take() else {
                    return refuse(
                        StatusCode::BAD_GATEWAY,
                        "backend_error",
                        "the request cannot be sent again",
                    );
                };
                let out = match to_backend(head, body.take().unwrap_or_else(empty), addr, &path) {
                    Ok(r) => keep_head(r, &mut parts, h2, replayable, failed.is_some()),
                    Err(e) => return json_error(StatusCode::BAD_REQUEST, "bad_request", &e),
                };
                let sent = self.send(h2, addr, out);
                let answered = match route.backend_timeout_ms {
                    0 => sent.await,
                    ms => match tokio::time::timeout(Duration::from_millis(ms), sent).await {
                        Ok(r) => r,
                        Err(_) => {
                            return timed_out(
                                "the backend did not begin its answer within the rule's timeout,",
                                "backend_timeout",
                                ms,
                            );
                        }
                    },
                };
                match answered {
                    Ok(mut resp) => {
                        let load = resp
                            .headers()
                            .get("x-runner-load")
                            .and_then(|v| crate::discovery::parse_load(v.as_bytes()));
                        let rtt_us = slot.answered(resp.status().as_u16(), load);
                        if let Some(entry) = &app {
                            entry.traffic.answered(resp.status().as_u16(), Some(rtt_us));
                        }
                        if resp.status() == StatusCode::SWITCHING_PROTOCOLS
                            && let Some(client_upgrade) = client_upgrade.take()
                        {
                            let backend_upgrade = hyper::upgrade::on(&mut resp);
                            tokio::spawn(tunnel(
                                client_upgrade,
                                backend_upgrade,
                                (in_flight.take(), slot, self.tunnel_guard()),
                                app.as_ref()
                                    .map(|e| e.spec.connection_idle_timeout_ms)
                                    .filter(|ms| *ms > 0)
                                    .map(Duration::from_millis),
                                app.as_ref().map(|e| e.traffic.clone()),
                                self.clock.clone(),
                            ));
                            let (parts, _) = resp.into_parts();
                            return Response::from_parts(parts, empty());
                        }
                        let (mut parts, body) = resp.into_parts();
                        strip_hop_by_hop(&mut parts.headers);
                        change_headers(&mut parts.headers, &route.response_headers);
                        let body = Counted {
                            inner: body,
                            _in_flight: in_flight.take(),
                            _slot: slot,
                        };
                        return Response::from_parts(parts, body.boxed());
                    }
                    Err(mut e) => {
                        slot.failed();
                        let again = try_again(&mut e, replayable, failed.is_some());
                        if let Some(again) = again
                            && ready().items().len() > 1
                        {
                            again.restore(&mut e, &mut parts, &mut body);
                            tracing::debug!(service = %service.meta.id, %addr, error = %e, "instance went away; retrying");
                            failed = Some(addr);
                            continue;
                        }
                        if let Some(entry) = &app {
                            entry.traffic.answered(502, None);
                        }
                        return refuse(
                            StatusCode::BAD_GATEWAY,
                            "backend_error",
                            &format!("instance {addr}: {e}"),
                        );
                    }
                }
            }
        };
        match request_ms {
            0 => tries.await,
            ms => match tokio::time::timeout(Duration::from_millis(ms), tries).await {
                Ok(r) => r,
                Err(_) => timed_out(
                    "no answer began within the rule's timeout or the call's deadline,",
                    "request_timeout",
                    ms,
                ),
            },
        }
    }

    /// Sends a request on to the backend at `addr` (`out`'s URI points there): over HTTP/2
    /// without TLS when `h2` (gRPC, an h2c backend; the `Host` dropped, `:authority` being the
    /// address dialled; [`h2hop`]), else HTTP/1.1.
    async fn send(
        &self,
        h2: bool,
        addr: SocketAddr,
        out: Request<Body>,
    ) -> Result<Response<Body>, SendError> {
        let dial = self.dial();
        if h2 {
            h2hop::send(grpc::for_backend(out), addr, dial, &self.backends).await
        } else {
            h1hop::send(out, addr, dial, &self.backends).await
        }
    }

    /// How connections to replicas are opened and kept (both paths, both hops).
    fn dial(&self) -> backends::Dial<'_> {
        backends::Dial {
            attempt_ms: self.options.connect_attempt_ms,
            timeout_ms: self.options.connect_timeout_ms,
            max_idle: self.options.pool_max_idle_per_host,
            idle_timeout_ms: self.options.pool_idle_timeout_ms,
            max_header_list_size: u32::try_from(self.options.limits.max_head_bytes)
                .unwrap_or(u32::MAX),
            clock: &self.clock,
        }
    }

    /// The instances of destination `di` of rule `ri` of a meta service now.
    fn service_ready(
        &self,
        service: &services::ServiceEntry,
        ri: usize,
        di: usize,
    ) -> Arc<backends::Ready> {
        let version = *self.orch_version.borrow();
        service.ready(ri, di, version, &self.backends, |id| self.resolve(id))
    }

    /// A slot on an instance of destination `di` of rule `ri` of a meta service, other than
    /// `avoid` when there is another: an `ebb://app`'s replicas (`app`) held and woken for as
    /// the app's requests are ([`Proxy::endpoint_on`]), else the destination's instances under
    /// its policy (503 `no_instance` when it has none).
    #[allow(clippy::too_many_arguments)]
    async fn service_slot(
        &self,
        service: &services::ServiceEntry,
        ri: usize,
        di: usize,
        app: Option<&Entry>,
        avoid: Option<SocketAddr>,
        key: Option<u64>,
        id: &[u8],
        span: Option<&opentelemetry::Context>,
    ) -> Result<Slot, Refusal> {
        let ready = || self.service_ready(service, ri, di);
        if let Some(app) = app {
            return self
                .endpoint_on(app, avoid, key, id, false, span, &ready)
                .await;
        }
        let ready = ready();
        let take = |avoid| backends::take_slot(&ready, avoid, 0, key, &service.group);
        // The one instance that went away is tried again rather than none.
        take(avoid)
            .or_else(|| avoid.and_then(|_| take(None)))
            .ok_or_else(|| {
                Refusal::unavailable(
                    "no_instance",
                    format!(
                        "destination {} of {} has no instance to send to",
                        di + 1,
                        service.meta.id
                    ),
                )
            })
    }

    /// The ready replicas of one of ebb's apps (an `ebb://app` destination, a Gateway backend's
    /// route) now.
    fn resolve(&self, app: &str) -> Vec<SocketAddr> {
        let deployment = self
            .log
            .read(|s| s.routes.by_name.get(app).map(|r| r.spec.deployment.clone()));
        deployment
            .and_then(|d| self.orch.observe(&d))
            .map(|o| o.ready)
            .unwrap_or_default()
    }

    /// A slot on a ready replica other than `avoid` ([`backends::take_slot`]). While there is
    /// none the request is held: the workload is woken when no replica is ready, and the request
    /// takes the first slot that a replica becoming ready or a request ending frees.
    /// `key`: the request's hash key, for a consistent-hash policy.
    /// `id`: the request's id, for the lines logged about it while it is held.
    /// `page`: a browser's page load, answered with the route's waiting page (if it has one)
    /// instead of being held.
    ///
    /// A replica with room now is taken at once; the hold is a future of its own, boxed, so that
    /// the state of every request (which holds this future) does not carry the hold's.
    async fn endpoint(
        &self,
        entry: &Entry,
        avoid: Option<SocketAddr>,
        key: Option<u64>,
        id: &[u8],
        page: bool,
        span: Option<&opentelemetry::Context>,
    ) -> Result<Slot, Refusal> {
        let free = backends::take_slot(
            &self.ready(entry),
            avoid,
            entry.spec.concurrency,
            key,
            &entry.group,
        );
        if let Some(slot) = free {
            return Ok(slot);
        }
        let ready = || self.ready(entry);
        Box::pin(self.endpoint_on(entry, avoid, key, id, page, span, &ready)).await
    }

    /// [`Proxy::endpoint`] with the route's replicas as `ready` gives them (a meta service's
    /// `ebb://app` destination: the app's replicas under the destination's policy).
    #[allow(clippy::too_many_arguments)]
    async fn endpoint_on(
        &self,
        entry: &Entry,
        avoid: Option<SocketAddr>,
        key: Option<u64>,
        id: &[u8],
        page: bool,
        traced: Option<&opentelemetry::Context>,
        ready: &(dyn Fn() -> Arc<backends::Ready> + Send + Sync),
    ) -> Result<Slot, Refusal> {
        let route = &entry.spec;
        let pick = || backends::take_slot(&ready(), avoid, route.concurrency, key, &entry.group);
        let has_ready = || ready().items().iter().any(|r| Some(r.addr) != avoid);
        if let Some(slot) = pick() {
            return Ok(slot);
        }
        if page
            && let Some(wp) = &route.waiting_page
            && !has_ready()
        {
            // A browser's page load while the workload is down: wake it (once, whoever asks)
            // and answer with the page, which comes back until a replica is ready.
            if let Some(guard) = entry.traffic.begin_wake() {
                let (log, orch, route) = (self.log.clone(), self.orch.clone(), route.clone());
                tokio::spawn(async move {
                    if let Err(e) = wake(&log, &*orch, &route).await {
                        tracing::warn!(route = %route.name, error = %e, "wake failed");
                    }
                    drop(guard);
                });
            }
            let cold_ms = self.log.read(|s| {
                s.routes
                    .deployments
                    .get(&route.deployment)
                    .map_or(0, |d| d.cold_start_ms)
            });
            return Err(Refusal::waiting(
                waiting::render(wp, &route.name, cold_ms),
                waiting::refresh_s(wp),
            ));
        }
        // A span at `info`, so the wake's line (once per wake) carries the id of the request that
        // woke it; each held request's own lines are at `debug` (a cold burst holds thousands).
        let span = tracing::info_span!(
            "request",
            id = %String::from_utf8_lossy(id),
            route = %route.name
        );
        let max_held = self.options.limits.max_held;
        if self.held.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= max_held {
            self.held.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            crate::limits::Limit::Held.hit();
            tracing::warn!(parent: &span, limit = max_held, "refused: too many requests held");
            return Err(Refusal::unavailable(
                "too_many_held",
                format!("{max_held} requests already wait for workloads to wake (--max-held)"),
            ));
        }
        let _held_all = HeldAll(&self.held);
        let Some(_held) = entry.traffic.hold(route.hold_queue_max) else {
            crate::limits::Limit::HeldPerRoute.hit();
            tracing::warn!(parent: &span, limit = route.hold_queue_max, "refused: the hold queue is full");
            return Err(Refusal::unavailable(
                "hold_queue_full",
                format!(
                    "{} requests already wait for {}",
                    route.hold_queue_max, route.name
                ),
            ));
        };
        // Traced: the hold's span under the request's, and the wake's under the hold that
        // starts it; every hold links to the wake it waits for.
        let hold = match traced {
            Some(cx) => {
                let hold = tracing::info_span!(
                    parent: &span,
                    "proxy.hold",
                    ebb.route = %route.name,
                    ebb.hold.reason = if has_ready() { "replicas_busy" } else { "no_ready_replica" },
                    ebb.held_ms = tracing::field::Empty,
                    ebb.outcome = tracing::field::Empty,
                );
                let _ = hold.set_parent(cx.clone());
                hold
            }
            None => tracing::Span::none(),
        };
        let mut linked = hold.is_none();
        let mut changes = self.orch.changes();
        let wait = async {
            // The wake runs as a task of its own, so that it completes even when the request that
            // started it is abandoned; the requests held meanwhile only wait for it.
            let mut waking: Option<tokio::task::JoinHandle<Result<(), String>>> = None;
            let mut woke = false;
            loop {
                let freed = entry.group.slot_freed();
                tokio::pin!(freed);
                freed.as_mut().enable();
                if let Some(slot) = pick() {
                    return Ok(slot);
                }
                // Wake once; again if the workload was asked down since (a scale-down by another
                // ebb replica, or this one's, recorded only after its write took effect), so a
                // held request never waits for replicas nobody asked for.
                let asked_down = woke
                    && waking.is_none()
                    && self
                        .orch
                        .observe(&route.deployment)
                        .is_some_and(|o| o.desired == 0);
                if (!woke || asked_down) && !has_ready() {
                    woke = true;
                    // Single flight: while one held request wakes the workload, the others wait.
                    if let Some(guard) = entry.traffic.begin_wake() {
                        let (log, orch, route) =
                            (self.log.clone(), self.orch.clone(), route.clone());
                        let within = if hold.is_none() {
                            tracing::Span::current()
                        } else {
                            let scale = tracing::info_span!(
                                parent: &hold,
                                "scale",
                                ebb.route = %route.name,
                                ebb.scale.reason = "a request is held and no replica is ready",
                                ebb.scale.from = tracing::field::Empty,
                                ebb.scale.to = tracing::field::Empty,
                            );
                            guard.traced(scale.context().span().span_context().clone());
                            scale
                        };
                        waking = Some(tokio::spawn(
                            async move {
                                let r = wake(&log, &*orch, &route).await;
                                drop(guard);
                                r
                            }
                            .instrument(within),
                        ));
                    }
                }
                if !linked && let Some(scale) = entry.traffic.wake_span() {
                    hold.add_link(scale);
                    linked = true;
                }
                tokio::select! {
                    r = changes.changed() => if r.is_err() {
                        return Err(None);
                    },
                    () = &mut freed => {}
                    () = tokio::time::sleep(Duration::from_millis(backends::RECHECK_MS)) => {}
                    r = async { waking.as_mut().expect("guarded").await }, if waking.is_some() => {
                        waking = None;
                        match r {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => return Err(Some(e)),
                            Err(e) => return Err(Some(e.to_string())),
                        }
                    }
                }
            }
        };
        tracing::debug!(parent: &span, "held: no replica is free; waiting");
        let watch = crate::clock::Stopwatch::start();
        let waited = tokio::time::timeout(Duration::from_millis(route.hold_timeout_ms), wait)
            .instrument(span.clone())
            .await;
        let held = watch.elapsed();
        let trace = traced.map(|cx| cx.span().span_context().trace_id().to_string());
        self.traffic.observe_hold(held, trace);
        let held_ms = held.as_millis() as u64;
        if waited.is_err() {
            entry.traffic.timed_out(traffic::Timeout::Hold);
        }
        let answer = match waited {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(Some(e))) => Err(Refusal::unavailable("wake_failed", e)),
            _ if has_ready() => Err(Refusal::unavailable(
                "replicas_busy",
                format!(
                    "every replica of {} serves {} requests already; none was free within {} ms",
                    route.name, route.concurrency, route.hold_timeout_ms
                ),
            )),
            _ => Err(Refusal::unavailable(
                "wake_timeout",
                format!(
                    "{} has no ready replica after {} ms",
                    route.name, route.hold_timeout_ms
                ),
            )),
        };
        if !hold.is_none() {
            hold.record("ebb.held_ms", held_ms);
            hold.record(
                "ebb.outcome",
                match &answer {
                    Ok(_) => "forwarded",
                    Err(r) => r.code,
                },
            );
        }
        match &answer {
            Ok(slot) => {
                tracing::info!(parent: &span, held_ms, replica = %slot.addr(), "forwarding")
            }
            Err(r) => {
                tracing::warn!(parent: &span, held_ms, code = r.code, "refused: {}", r.message)
            }
        }
        answer
    }

    /// The route's ready replicas, read from the orchestrator only when it reported a change.
    fn ready(&self, entry: &Entry) -> Arc<backends::Ready> {
        let version = *self.orch_version.borrow();
        if let Some(ready) = entry.ready_at(version) {
            return ready;
        }
        let addrs = self
            .orch
            .observe(&entry.spec.deployment)
            .map(|o| o.ready)
            .unwrap_or_default();
        entry.set_ready(version, &addrs, &self.backends)
    }
}

/// Logs the wake decision (once per wake, whoever asks) and makes sure the orchestrator runs the
/// workload.
async fn wake(log: &Log, orch: &dyn Orchestrator, route: &RouteSpec) -> Result<(), String> {
    let name = route.name.clone();
    let (want, _) = log
        .decide(move |s: &State, now| {
            let wake = decide_wake(s, &name, now);
            let want = match &wake {
                Some(Event::ScaleRequested { to, .. }) => *to,
                _ => s
                    .routes
                    .by_name
                    .get(&name)
                    .map_or(1, |r| awake_replicas(&r.spec).max(warm_min(&r.spec, now))),
            };
            (wake.into_iter().collect(), want)
        })
        .await
        .map_err(|e| e.to_string())?;
    let desired = orch.observe(&route.deployment).map_or(0, |o| o.desired);
    // On the wake's `scale` span when it is traced (a no-op on any other).
    let span = tracing::Span::current();
    span.record("ebb.scale.from", desired);
    span.record("ebb.scale.to", want.max(desired));
    if desired < want {
        orch.scale(&route.deployment, want)
            .map_err(|e| e.to_string())?;
    }
    tracing::info!(
        deployment = %route.deployment,
        replicas = want.max(desired),
        "woken: the wake is logged and the workload asked to scale"
    );
    Ok(())
}

/// The host a request on the general path is routed by and the origin-form target its backend
/// gets ([`head::target`]); on HTTP/2 the `:authority`, which a `Host` header must not contradict.
fn routed_by<B>(req: &Request<B>) -> Result<(String, String), head::HeadError> {
    let hosts: Vec<&[u8]> = req
        .headers()
        .get_all(header::HOST)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    let target = req.uri().to_string();
    let h2 = req.version() == hyper::Version::HTTP_2;
    if h2
        && let (Some(authority), [host]) = (req.uri().authority(), hosts.as_slice())
        && !authority
            .as_str()
            .as_bytes()
            .eq_ignore_ascii_case(host.trim_ascii())
    {
        return Err(head::HeadError::HostConflict);
    }
    let http11 = req.version() == hyper::Version::HTTP_11;
    let t = head::target(req.method().as_str(), &target, &hosts, http11)?;
    Ok((t.host.to_owned(), t.path.into_owned()))
}

/// The URI authority of a backend, built once per address and thread.
fn authority(addr: SocketAddr) -> hyper::http::uri::Authority {
    thread_local! {
        static CACHE: std::cell::RefCell<std::collections::HashMap<SocketAddr, hyper::http::uri::Authority>> =
            std::cell::RefCell::new(std::collections::HashMap::new());
    }
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() > 4_096 {
            c.clear();
        }
        c.entry(addr)
            .or_insert_with(|| {
                hyper::http::uri::Authority::try_from(addr.to_string())
                    .expect("a socket address is an authority")
            })
            .clone()
    })
}

/// The protocol a request asks to upgrade to (`Connection: upgrade` with an `Upgrade` header).
fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

/// Copies bytes both ways between an upgraded client and backend connection; the connection counts
/// as in flight (so its workload is never idle) until both sides are done.
/// Past the route's `connection_idle_timeout_ms` without a byte either way, both are closed.
async fn tunnel<G: Send + 'static>(
    client: hyper::upgrade::OnUpgrade,
    backend: hyper::upgrade::OnUpgrade,
    guards: G,
    idle: Option<Duration>,
    counts: Option<Arc<traffic::RouteTraffic>>,
    clock: Arc<dyn Clock>,
) {
    let (client, backend) = match tokio::try_join!(client, backend) {
        Ok(pair) => pair,
        Err(e) => {
            tracing::debug!(error = %e, "upgrade failed");
            return;
        }
    };
    match splice::splice(TokioIo::new(client), TokioIo::new(backend), idle, &*clock).await {
        Ok(splice::Ended::Idle) => {
            if let Some(counts) = counts {
                counts.timed_out(traffic::Timeout::ConnectionIdle);
            }
            tracing::debug!("upgraded connection idle past connection_idle_timeout_ms; closed");
        }
        Ok(splice::Ended::Closed { .. }) => {}
        Err(e) => tracing::debug!(error = %e, "upgraded connection ended with an error"),
    }
    drop(guards);
}

/// Why a request sent on to a backend got no answer's head (either hop: [`h1hop`], [`h2hop`]).
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The connection could not be made; with the request given back whole when the hop had
    /// it (none of it left ebb), so it can be tried again, body and all ([`SendError::unsent`]).
    #[error("connecting: {0}")]
    Connect(std::io::Error, Option<Unsent>),
    #[error("{0}")]
    H1(#[from] hyper::Error),
    #[error("{0}")]
    H2(#[from] h2hop::Error),
    #[error("{0}")]
    Raw(#[from] RawError),
    /// The replica closed or reset the connection before the answer's head came, in the
    /// HTTP/1.1 hop's own exchange: with the head of the request (which had no body) given back
    /// until taken ([`SendError::take_head`]), so it can be tried again without a copy kept.
    #[error("{0}")]
    Gone(RawError, Option<Box<hyper::http::request::Parts>>),
}

/// Why the HTTP/1.1 hop's own exchange ([`h1hop`]) got no answer's head.
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    #[error("the replica closed the connection before answering")]
    Closed,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Malformed(String),
}

impl RawError {
    /// The replica closed or reset the connection (or refused it) before the whole answer's head
    /// came: the request was not processed.
    fn went_away(&self) -> bool {
        match self {
            RawError::Closed => true,
            RawError::Io(e) => backends::cut_off(e),
            RawError::Malformed(_) => false,
        }
    }
}

/// A request a hop gives back because it could not connect: none of it left ebb.
pub struct Unsent(Box<Request<Body>>);

impl std::fmt::Debug for Unsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Unsent")
    }
}

impl SendError {
    /// A connect error (of the dial, before any request).
    fn connect(e: std::io::Error) -> Self {
        SendError::Connect(e, None)
    }

    /// The connection could not be made.
    fn is_connect(&self) -> bool {
        matches!(self, SendError::Connect(..))
    }

    /// `self` with `req` given back when it is a connect error (else `req` is dropped).
    fn unsent(self, req: Request<Body>) -> Self {
        match self {
            SendError::Connect(e, _) => SendError::Connect(e, Some(Unsent(Box::new(req)))),
            other => other,
        }
    }

    /// The request a connect error gave back, taken out.
    fn take_unsent(&mut self) -> Option<Box<Request<Body>>> {
        match self {
            SendError::Connect(_, unsent) => unsent.take().map(|u| u.0),
            _ => None,
        }
    }

    /// The request's head the hop gave back when the replica went away, taken out.
    fn take_head(&mut self) -> Option<hyper::http::request::Parts> {
        match self {
            SendError::Gone(_, head) => head.take().map(|h| *h),
            _ => None,
        }
    }
}

/// How a failed try goes again on another replica ([`try_again`]).
enum Again {
    /// With the request the hop gave back whole: its connection was refused, none of it left
    /// ebb, its body untouched.
    Whole(Box<Request<Body>>),
    /// With the head kept for it: the connection was cut off after the request was sent, which
    /// only a request without a body survives.
    Head,
}

impl Again {
    /// Puts back what the next try sends: the request the hop gave back whole, or the head it
    /// gave back when the replica went away (else the copy [`keep_head`] kept stays).
    fn restore(
        self,
        e: &mut SendError,
        parts: &mut Option<hyper::http::request::Parts>,
        body: &mut Option<Body>,
    ) {
        match self {
            Again::Whole(req) => {
                let (p, b) = (*req).into_parts();
                *parts = Some(p);
                *body = Some(b);
            }
            Again::Head => {
                if let Some(head) = e.take_head() {
                    *parts = Some(head);
                }
            }
        }
    }
}

/// Keeps a copy of `out`'s head in `parts` for another try while one can come (a request that
/// can be sent again, not tried yet: [`retry_after_miss`]) and the hop will not give it back
/// itself (the HTTP/1.1 hop's own exchange does: [`h1hop::gives_head_back`]); otherwise the head
/// moves into the request, uncopied. (A copy for each request was a fortieth of ebb's CPU on
/// h2c GETs.)
fn keep_head(
    out: Request<Body>,
    parts: &mut Option<hyper::http::request::Parts>,
    h2: bool,
    replayable: bool,
    retried: bool,
) -> Request<Body> {
    if retry_after_miss(BackendMiss::WentAway { replayable }, retried)
        && (h2 || !h1hop::gives_head_back(&out))
    {
        let (p, b) = out.into_parts();
        *parts = Some(p.clone());
        return Request::from_parts(p, b);
    }
    out
}

/// Whether a try that failed with `e` goes again ([`retry_after_miss`]), and how. `replayable`:
/// the request has no body; `retried`: it was tried again already.
fn try_again(e: &mut SendError, replayable: bool, retried: bool) -> Option<Again> {
    if let Some(req) = e.take_unsent()
        && retry_after_miss(BackendMiss::Refused, retried)
    {
        return Some(Again::Whole(req));
    }
    ((e.is_connect() || backend_went_away(e))
        && retry_after_miss(BackendMiss::WentAway { replayable }, retried))
    .then_some(Again::Head)
}

/// Whether the backend closed or reset the connection before answering (or refused it, or the
/// HTTP/2 stream): the request was not processed.
fn backend_went_away(e: &SendError) -> bool {
    use std::error::Error as _;
    match e {
        SendError::Connect(..) => false,
        SendError::H1(e) => {
            if e.is_incomplete_message() || e.is_closed() || e.is_canceled() {
                return true;
            }
            let mut source = e.source();
            while let Some(s) = source {
                if s.downcast_ref::<std::io::Error>()
                    .is_some_and(backends::gone)
                {
                    return true;
                }
                source = s.source();
            }
            false
        }
        SendError::Raw(e) | SendError::Gone(e, _) => e.went_away(),
        SendError::H2(e) => e.went_away(),
    }
}

/// Keeps the client's first usable `X-Request-Id` (dropping any others) or adds one made here;
/// returns it.
///
/// The id is marked sensitive, which HPACK writes as a literal never indexed: a value that
/// differs in every request gains nothing from the HTTP/2 encoder's table, and each one indexed
/// would evict an entry that is reused and lengthen the chain of `x-request-id` values every
/// later id is compared with before it is added (measured: the table's search was a twentieth of
/// the proxy's CPU under gRPC load).
fn ensure_request_id(headers: &mut HeaderMap) -> HeaderValue {
    static NAME: HeaderName = HeaderName::from_static(request_id::HEADER);
    let given = headers
        .get_all(&NAME)
        .iter()
        .find(|v| request_id::usable(v.as_bytes()))
        .cloned();
    let mut id = given.unwrap_or_else(|| {
        HeaderValue::from_bytes(&request_id::make()).expect("hex digits are a header value")
    });
    id.set_sensitive(true);
    headers.insert(&NAME, id.clone());
    id
}

/// How many headers [`add_forwarded`] and [`ensure_request_id`] may add to a request.
const FORWARDING_HEADERS: usize = 5;

/// Marks a request that came over TLS (the proxy terminated it).
#[derive(Debug, Clone, Copy)]
struct Https;

/// `X-Forwarded-For` (after the client's own), `-Proto` and `-Host`, and `Forwarded` (after the
/// client's own): each value written once into its own buffer, under a name known beforehand, as
/// every request of the general path pays for it.
fn add_forwarded(headers: &mut HeaderMap, peer: SocketAddr, host: &str, https: bool) {
    use std::fmt::Write as _;
    static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
    static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
    thread_local! {
        /// The values of the thread's last request without forwarding headers of its own: the
        /// streams of one HTTP/2 connection share them (same client, same host), so each is
        /// written once, not once a stream.
        static LAST: std::cell::RefCell<Option<ForwardedValues>> =
            const { std::cell::RefCell::new(None) };
    }
    // Room for these and the request id at once, not a growth per header.
    headers.reserve(FORWARDING_HEADERS);
    let proto = if https { "https" } else { "http" };
    let ip = peer.ip();
    let value = |s: String| HeaderValue::from_maybe_shared(Bytes::from(s)).ok();
    let own = headers.contains_key(&X_FORWARDED_FOR) || headers.contains_key(header::FORWARDED);
    let values = if own {
        None
    } else {
        LAST.with(|last| {
            last.borrow()
                .as_ref()
                .filter(|v| v.ip == ip && v.https == https && v.host == host)
                .map(|v| v.values.clone())
        })
    };
    let [xff, xfh, forwarded] = match values {
        Some(v) => v.map(Some),
        None => {
            let earlier = |name: &HeaderName| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(|prev| format!("{prev}, "))
                    .unwrap_or_default()
            };
            let mut xff = earlier(&X_FORWARDED_FOR);
            let _ = write!(xff, "{ip}");
            let mut forwarded = earlier(&header::FORWARDED);
            let _ = if peer.is_ipv6() {
                write!(forwarded, "for=\"[{ip}]\"")
            } else {
                write!(forwarded, "for={ip}")
            };
            let _ = write!(forwarded, ";host=\"{host}\";proto={proto}");
            let made = [
                value(xff),
                HeaderValue::from_str(host).ok(),
                value(forwarded),
            ];
            if !own && let [Some(a), Some(b), Some(c)] = &made {
                LAST.with(|last| {
                    *last.borrow_mut() = Some(ForwardedValues {
                        ip,
                        https,
                        host: host.to_owned(),
                        values: [a.clone(), b.clone(), c.clone()],
                    })
                });
            }
            made
        }
    };
    if let Some(v) = xff {
        headers.insert(&X_FORWARDED_FOR, v);
    }
    headers.insert(&X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    if let Some(v) = xfh {
        headers.insert(&X_FORWARDED_HOST, v);
    }
    if let Some(v) = forwarded {
        headers.insert(header::FORWARDED, v);
    }
}

/// [`add_forwarded`]'s values for one client address, scheme and host: `X-Forwarded-For`,
/// `X-Forwarded-Host` and `Forwarded`.
struct ForwardedValues {
    ip: std::net::IpAddr,
    https: bool,
    host: String,
    values: [HeaderValue; 3],
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    #[test]
    fn forwarding_headers_follow_the_clients_own_and_quote_an_ipv6_node() {
        let mut headers = HeaderMap::new();
        headers.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        headers.insert(header::FORWARDED, HeaderValue::from_static("for=10.0.0.1"));
        headers.insert("x-forwarded-proto", HeaderValue::from_static("ftp"));
        add_forwarded(
            &mut headers,
            "127.0.0.1:5000".parse().unwrap(),
            "a.localhost",
            false,
        );
        assert_eq!(header(&headers, "x-forwarded-for"), "10.0.0.1, 127.0.0.1");
        assert_eq!(header(&headers, "x-forwarded-proto"), "http");
        assert_eq!(header(&headers, "x-forwarded-host"), "a.localhost");
        assert_eq!(
            header(&headers, "forwarded"),
            "for=10.0.0.1, for=127.0.0.1;host=\"a.localhost\";proto=http"
        );

        let mut headers = HeaderMap::new();
        add_forwarded(
            &mut headers,
            "[::1]:5000".parse().unwrap(),
            "b.localhost:8080",
            true,
        );
        assert_eq!(header(&headers, "x-forwarded-for"), "::1");
        assert_eq!(header(&headers, "x-forwarded-proto"), "https");
        assert_eq!(
            header(&headers, "forwarded"),
            "for=\"[::1]\";host=\"b.localhost:8080\";proto=https"
        );
        assert_eq!(headers.len(), 4);

        // The thread keeps the last values written: the same client and host get them again,
        // another host or a client's own headers new ones.
        let forwarded = |peer: &str, host: &str, own: Option<&'static str>| {
            let mut headers = HeaderMap::new();
            if let Some(v) = own {
                headers.insert("x-forwarded-for", HeaderValue::from_static(v));
            }
            add_forwarded(&mut headers, peer.parse().unwrap(), host, false);
            (
                header(&headers, "x-forwarded-for").to_owned(),
                header(&headers, "x-forwarded-host").to_owned(),
                header(&headers, "forwarded").to_owned(),
            )
        };
        let first = forwarded("127.0.0.2:1", "c.localhost", None);
        assert_eq!(first, forwarded("127.0.0.2:2", "c.localhost", None));
        assert_eq!(
            forwarded("127.0.0.2:2", "d.localhost", None),
            (
                "127.0.0.2".to_owned(),
                "d.localhost".to_owned(),
                "for=127.0.0.2;host=\"d.localhost\";proto=http".to_owned()
            )
        );
        assert_eq!(
            forwarded("127.0.0.3:1", "d.localhost", Some("10.0.0.9")).0,
            "10.0.0.9, 127.0.0.3"
        );
        assert_eq!(forwarded("127.0.0.3:1", "d.localhost", None).0, "127.0.0.3");
    }

    #[test]
    fn a_request_id_is_kept_when_usable_and_made_otherwise() {
        let mut headers = HeaderMap::new();
        headers.insert(request_id::HEADER, HeaderValue::from_static("abc-1"));
        let kept = ensure_request_id(&mut headers);
        assert_eq!(kept, "abc-1");
        assert_eq!(header(&headers, request_id::HEADER), "abc-1");
        // Never indexed by HPACK, kept or made: a value of its own in every request.
        assert!(kept.is_sensitive());
        assert!(headers[request_id::HEADER].is_sensitive());
        let mut headers = HeaderMap::new();
        headers.insert(request_id::HEADER, HeaderValue::from_static("has space"));
        let made = ensure_request_id(&mut headers);
        assert_eq!(made.len(), 32);
        assert_eq!(headers.get_all(request_id::HEADER).iter().count(), 1);
        assert_eq!(headers.get(request_id::HEADER), Some(&made));
        assert!(headers[request_id::HEADER].is_sensitive());
    }

    #[test]
    fn a_copy_of_the_head_is_kept_only_for_another_try_the_hop_cannot_give_it_back_for() {
        let out = |body: Body| {
            let (parts, _) = Request::get("http://x.localhost/a")
                .header("a", "1")
                .body(())
                .unwrap()
                .into_parts();
            let path = hyper::http::uri::PathAndQuery::from_static("/a");
            to_backend(parts, body, "127.0.0.1:9000".parse().unwrap(), &path).unwrap()
        };
        let full = || {
            http_body_util::Full::new(bytes::Bytes::from_static(b"x"))
                .map_err(|e| match e {})
                .boxed()
        };
        // (h2, replayable, retried, body) -> a copy kept
        for (h2, replayable, retried, with_body, kept) in [
            // HTTP/1.1 without a body: ebb's own exchange gives the head back.
            (false, true, false, false, false),
            // Over HTTP/2 it does not.
            (true, true, false, false, true),
            // A body streams through hyper's exchange, which does not either (and a request
            // with a body is sent again only when none of it left ebb: given back whole).
            (false, true, false, true, true),
            // No other try can come.
            (true, false, false, false, false),
            (true, true, true, false, false),
        ] {
            let mut parts = None;
            let body = if with_body { full() } else { empty() };
            let sent = keep_head(out(body), &mut parts, h2, replayable, retried);
            assert_eq!(
                parts.is_some(),
                kept,
                "{h2} {replayable} {retried} {with_body}"
            );
            assert_eq!(sent.uri(), "http://127.0.0.1:9000/a");
            if let Some(p) = parts {
                assert_eq!((p.uri, header(&p.headers, "a")), (sent.uri().clone(), "1"));
            }
        }
    }

    #[test]
    fn the_backends_request_takes_the_head_and_points_at_the_replica() {
        let (mut parts, _) = Request::get("http://x.localhost/old")
            .header("a", "1")
            .body(())
            .unwrap()
            .into_parts();
        parts.method = hyper::Method::POST;
        let path = hyper::http::uri::PathAndQuery::from_static("/new?q=1");
        let out = to_backend(parts, empty(), "127.0.0.1:9000".parse().unwrap(), &path).unwrap();
        assert_eq!(out.uri(), "http://127.0.0.1:9000/new?q=1");
        assert_eq!(out.method(), hyper::Method::POST);
        assert_eq!(header(out.headers(), "a"), "1");
    }
}
