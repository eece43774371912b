//! The HTTP/1.1 forwarding path: the common case (an HTTP/1.1 request without upgrade) handled
//! on the raw connections, the way nginx does it, without building request and response objects.
//!
//! * The request head is parsed with `httparse` and rewritten once into the backend's head (by
//!   `ebb_http::h1`, which also writes the request id there and keeps its range): routed by
//!   [`head::target`](super::head::target) (one valid `Host`, or 400; an absolute-form
//!   target's authority wins and the backend gets the origin form with it as `Host`), hop-by-hop
//!   headers (and those named in `Connection`) dropped, `X-Forwarded-For`, `-Proto`, `-Host` and
//!   `Forwarded` added. The response head is rewritten the same way. A head that does not parse,
//!   or whose body cannot be delimited (conflicting `Content-Length`s, a last transfer coding
//!   other than chunked), gets a JSON 400 and the connection is closed; with both
//!   `Transfer-Encoding: chunked` and `Content-Length`, the coding frames the body, the length
//!   is not forwarded and the connection ends after the answer (RFC 9112 section 6.1).
//! * Bodies stream through byte for byte in bounded buffers: `Content-Length` bodies by count,
//!   chunked ones passed through as they are, with [`Chunked`] finding where they end. A response
//!   without framing is read to the backend's close and ends the client connection too.
//! * Backend connections are kept per thread in a bounded pool of idle keep-alive connections.
//!   A request meets a backend connection in one task: a small response costs one read and one
//!   write on each side and no allocation beyond the connection's buffers. A pooled connection
//!   is checked for a close first only for a request with a body (a body-less request that meets
//!   a closed one is retried on a fresh one). A request that finds no idle connection opens one
//!   within the replica's bound on openings, or waits for an idle one to come back ([`backends`]).
//! * A request body is sent while the response is relayed, so `100 Continue` and early answers
//!   pass; a response that ends before the body was sent ends both connections.
//! * A client that leaves (its connection reaches its end or fails) while its request is held,
//!   waits for a connection or waits for the answer abandons the request at once: the backend
//!   connection is closed and the request no longer counts as in flight. To notice it, the
//!   client's side is read ahead while the request waits (bounded).
//! * One timer per connection (a watchdog, moved only when it fires) bounds an idle keep-alive
//!   connection (`client_idle_timeout_ms`, or after a request its route's
//!   `connection_idle_timeout_ms`), the reading of a head (`header_read_timeout_ms`) and a
//!   request under way that moves no byte either way (its route's `stream_idle_timeout_ms`, else
//!   `request_stall_timeout_ms`; a held request re-arms it, since the hold has its own bound).
//!   The wait for the answer's head is bounded by the route's `response_timeout_ms` (a 504).
//! * A meta service's request is matched against its rules on the parsed head; a rule that only
//!   forwards ([`super::services::fast_path`]) is applied by the head writers (the path
//!   rewrite, the Host, the request's and the answer's header changes) and the request goes to
//!   the destination it draws ([`Target::Service`]), held and woken as its app's when that is an
//!   `ebb://app`. Other rules are the general path's.
//! * Everything else (h2c, HTTP/1.0, upgrades such as WebSocket, transfer codings besides
//!   chunked) is handed, with the bytes read so far, to the general path on hyper
//!   ([`Proxy::serve_hyper`]), which serves the rest of that connection.
//!
//! The retry rules are the general path's: a request meeting a backend that refuses the
//! connection, or resets or closes it before answering, is retried once on another replica (waking
//! the workload again) when its body was not yet sent; a stale pooled connection is first retried
//! on a fresh connection to the same replica.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use hyper::StatusCode;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use ebb_http::chunked::Chunked;
use ebb_http::h1::{
    Framing, Parsed, Peer, Routes, ServiceMatch, parse_request, parse_response, push_display,
};

use super::backends::{self, Dial, Opening, Replica, Settling, Slot};
use super::table::Entry;
use super::{Proxy, Refusal};
use crate::clock::Clock;
use crate::event::RouteSpec;
use crate::limits::Limit;

/// A request head the fast path serves, with where it goes.
type Request = ebb_http::h1::Request<Target>;

/// Where a fast-path request goes: a workload route's replicas, or the destination a meta
/// service's rule drew (its fixed instances, or an `ebb://app`'s replicas, held and woken as the
/// app's requests are).
#[derive(Clone)]
pub enum Target {
    Route(Arc<Entry>),
    Service(Arc<ServiceTarget>),
}

/// A meta service's rule and destination for a request.
pub struct ServiceTarget {
    service: Arc<super::services::ServiceEntry>,
    /// The rule and the destination drawn.
    route: usize,
    dest: usize,
    /// The app of an `ebb://app` destination.
    app: Option<Arc<Entry>>,
}

impl Target {
    /// The route spec whose bounds and policy the request goes by.
    fn spec(&self) -> &RouteSpec {
        match self {
            Target::Route(e) => &e.spec,
            Target::Service(s) => s.service.spec(s.route, s.dest),
        }
    }

    /// The traffic that counts the request: its route's, or its `ebb://app`'s.
    fn traffic(&self) -> &Arc<super::RouteTraffic> {
        match self {
            Target::Route(e) => &e.traffic,
            Target::Service(s) => s.app.as_ref().map_or(&s.service.traffic, |a| &a.traffic),
        }
    }

    /// A meta service rule's changes to the response's headers.
    fn response_changes(&self) -> Option<&ebb_core::discovery::meta::Changes> {
        match self {
            Target::Route(_) => None,
            Target::Service(s) => Some(&s.service.meta.routes[s.route].response_headers),
        }
    }

    /// A slot on the replica or instance the request goes to, held and woken for as its
    /// workload's requests are ([`Proxy::endpoint`]).
    async fn endpoint(
        &self,
        proxy: &Proxy,
        avoid: Option<SocketAddr>,
        key: Option<u64>,
        id: &[u8],
        page: bool,
        span: Option<&opentelemetry::Context>,
    ) -> Result<Slot, Refusal> {
        match self {
            Target::Route(e) => proxy.endpoint(e, avoid, key, id, page, span).await,
            Target::Service(s) => {
                let app = s.app.as_deref();
                proxy
                    .service_slot(&s.service, s.route, s.dest, app, avoid, key, id, span)
                    .await
            }
        }
    }
}

/// The largest response head read from a backend (a request's is `--max-head-bytes`).
const MAX_HEAD: usize = 64 * 1024;
/// How much of a body is read at once.
const READ_CHUNK: usize = 64 * 1024;
/// Serves one client connection, handing it to the general path when a request needs it.
/// `gateway`: the Gateway API socket it came in on (a plain one), whose routes it is served by.
pub(super) async fn serve_connection(
    proxy: Arc<Proxy>,
    mut client: TcpStream,
    peer: SocketAddr,
    gateway: Option<SocketAddr>,
) {
    let routing = Routing {
        proxy: &proxy,
        gateway,
        span: std::cell::Cell::new(None),
        peer,
    };
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let mut head = Vec::with_capacity(1024);
    let mut out = Vec::with_capacity(8 * 1024);
    // The bound between requests: the last request's route's, else the proxy's.
    let mut idle_ms = proxy.options.client_idle_timeout_ms;
    let mut last_route: Option<Target> = None;
    let limits = proxy.options.limits;
    let progress = Progress::new(&*proxy.clock);
    let mut watchdog = Watchdog::new(&progress, idle_ms);
    let peer_text = Peer::new(peer);
    loop {
        // A read that begins a head marks the progress; the head's other reads do not, so that
        // the whole head must arrive within the header-read timeout of its first byte. Whether
        // the last mark is when the head began (or the previous request ended): if not, the
        // head's completion is marked, as a request's start is read from it.
        let mut fresh_mark = true;
        let req = loop {
            if !buf.is_empty() {
                head.clear();
                match parse_request(&buf, &peer_text, &routing, &mut head) {
                    Parsed::Request(r) => {
                        if !fresh_mark {
                            progress.mark();
                        }
                        break r;
                    }
                    Parsed::Refuse {
                        head_len,
                        refusal,
                        close,
                    } => {
                        let refusal = Refusal::from(refusal);
                        buf.advance(head_len);
                        if write_refusal(&mut client, &mut out, &proxy, &refusal, close)
                            .await
                            .is_err()
                            || close
                        {
                            return;
                        }
                        continue;
                    }
                    Parsed::Partial if buf.len() < limits.max_head_bytes => {}
                    Parsed::Partial => {
                        Limit::HeadBytes.hit();
                        let refusal = Refusal::new(
                            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                            "head_too_large",
                            format!(
                                "the request head is over {} bytes (--max-head-bytes)",
                                limits.max_head_bytes
                            ),
                        );
                        if write_refusal(&mut client, &mut out, &proxy, &refusal, true)
                            .await
                            .is_ok()
                        {
                            linger_close(client).await;
                        }
                        return;
                    }
                    Parsed::Elsewhere if buf.starts_with(b"PRI * HTTP/2.0\r\n") => {
                        // h2c with prior knowledge: ebb's own HTTP/2 server side.
                        proxy.serve_h2c(client, buf, peer, gateway).await;
                        return;
                    }
                    Parsed::Elsewhere => {
                        let io = Prefixed {
                            prefix: buf.freeze(),
                            inner: client,
                        };
                        proxy.serve_hyper_plain(io, peer, gateway).await;
                        return;
                    }
                }
            }
            if buf.capacity() - buf.len() < 1024 {
                buf.reserve(8 * 1024);
            }
            let in_head = !buf.is_empty();
            let limit_ms = if in_head {
                limits.header_read_timeout_ms
            } else {
                idle_ms
            };
            tokio::select! {
                biased;
                read = client.read_buf(&mut buf) => match read {
                    Ok(n) if n > 0 => {
                        fresh_mark = !in_head;
                        if fresh_mark {
                            progress.mark();
                        }
                    }
                    _ => return,
                },
                // Shutting down: an idle connection closes at once.
                () = proxy.drained(), if !in_head => return,
                () = watchdog.expired(&progress, limit_ms) => {
                    if !in_head && let Some(entry) = &last_route {
                        entry.traffic().timed_out(super::traffic::Timeout::ConnectionIdle);
                    }
                    if in_head {
                        Limit::HeaderReadTimeout.hit();
                        let refusal = Refusal::new(
                            StatusCode::REQUEST_TIMEOUT,
                            "header_read_timeout",
                            format!(
                                "the request head did not arrive within {} ms (--header-read-timeout-ms)",
                                limits.header_read_timeout_ms
                            ),
                        );
                        if write_refusal(&mut client, &mut out, &proxy, &refusal, true)
                            .await
                            .is_ok()
                        {
                            linger_close(client).await;
                        }
                    }
                    return;
                }
            }
        };
        buf.advance(req.head_len);
        // Its span, when tracing is on and it was sampled.
        let span = routing.span.take();
        let route = req.entry.spec();
        let stall_ms = match route.stream_idle_timeout_ms {
            0 => proxy.options.request_stall_timeout_ms,
            ms => ms,
        };
        let ended = {
            let exchanged = exchange(
                &proxy,
                &req.entry,
                &mut client,
                &mut buf,
                &head,
                &req,
                &mut out,
                &progress,
                span.as_ref(),
            );
            tokio::pin!(exchanged);
            loop {
                tokio::select! {
                    biased;
                    keep = &mut exchanged => break Some(keep),
                    () = watchdog.expired(&progress, stall_ms) => {
                        if progress.held.load(Ordering::Relaxed) {
                            // Held for a replica: the hold timeout bounds that, not this.
                            progress.mark();
                            continue;
                        }
                        break None;
                    }
                }
            }
        };
        let keep = match ended {
            Some(keep) => keep,
            None => {
                tracing::debug!(%peer, route = %route.name, "request stalled; closing");
                req.entry
                    .traffic()
                    .timed_out(super::traffic::Timeout::StreamIdle);
                if !progress.wrote.load(Ordering::Relaxed) {
                    // Nothing of an answer went out yet: say why before closing.
                    let refusal = Refusal::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "stream_idle_timeout",
                        format!(
                            "the request moved no byte either way for {stall_ms} ms (stream_idle_timeout_ms)"
                        ),
                    );
                    req.entry.traffic().answered(refusal.status.as_u16(), None);
                    progress.answered(refusal.status.as_u16());
                    let _ = write_refusal(&mut client, &mut out, &proxy, &refusal, true).await;
                }
                false
            }
        };
        if let Some(cx) = span {
            let rtt_us = progress.rtt_us.load(Ordering::Relaxed);
            if rtt_us > 0 {
                super::trace::exemplar(req.entry.traffic(), rtt_us, &cx, progress.at());
            }
            super::trace::answered(cx, progress.status.load(Ordering::Relaxed));
        }
        idle_ms = match route.connection_idle_timeout_ms {
            0 => proxy.options.client_idle_timeout_ms,
            ms => ms,
        };
        last_route = Some(req.entry.clone());
        if !keep && req.body != Framing::Empty {
            // The client may still be sending a body nobody reads: close gently, so that the
            // answer it was sent is not lost to a reset.
            linger_close(client).await;
            return;
        }
        if !keep || req.close || proxy.is_draining() {
            return;
        }
        progress.mark();
    }
}

/// Answers a connection over `--max-connections` with a 503 and closes it.
pub(super) async fn refuse_connection(proxy: Arc<Proxy>, mut client: TcpStream) {
    let refusal = Refusal::unavailable(
        "too_many_connections",
        format!(
            "{} client connections are open (--max-connections)",
            proxy.options.limits.max_connections
        ),
    );
    let mut out = Vec::with_capacity(512);
    if write_refusal(&mut client, &mut out, &proxy, &refusal, true)
        .await
        .is_ok()
    {
        linger_close(client).await;
    }
}

/// How long, and how many bytes, a closing connection's unread input is drained.
const LINGER_MS: u64 = 1_000;
const LINGER_BYTES: usize = 1 << 20;

/// Closes a connection whose peer may still be sending: our side is shut first, then what
/// arrives is read and dropped (bounded), so the peer reads our last answer before the close.
async fn linger_close(mut client: TcpStream) {
    if client.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut sink = vec![0u8; 16 * 1024];
        let mut total = 0;
        while total < LINGER_BYTES {
            match client.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(n) => total += n,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(LINGER_MS), drain).await;
}

/// A backend connection with its read buffer (the general path's HTTP/1.1 hop takes them from
/// the same pool: [`super::h1hop`]).
pub(super) struct Backend {
    pub(super) stream: TcpStream,
    pub(super) buf: BytesMut,
}

/// When a connection last moved bytes, for the stall and idle bounds, and whether anything went
/// to the client for the request under way.
pub(super) struct Progress<'a> {
    clock: &'a dyn Clock,
    at_ms: AtomicU64,
    wrote: AtomicBool,
    /// The request under way waits for a replica.
    held: AtomicBool,
    /// The status the request under way was answered with (0: not yet), for its span.
    status: AtomicU16,
    /// Microseconds from its replica being picked to its answer's head (0: ebb answered), for
    /// its span's exemplar.
    rtt_us: AtomicU64,
}

impl<'a> Progress<'a> {
    pub(super) fn new(clock: &'a dyn Clock) -> Self {
        Self {
            at_ms: AtomicU64::new(clock.now_ms()),
            clock,
            wrote: AtomicBool::new(false),
            held: AtomicBool::new(false),
            status: AtomicU16::new(0),
            rtt_us: AtomicU64::new(0),
        }
    }

    /// Notes the status the request under way was answered with.
    fn answered(&self, status: u16) {
        self.status.store(status, Ordering::Relaxed);
    }

    pub(super) fn mark(&self) {
        self.at_ms.store(self.clock.now_ms(), Ordering::Relaxed);
    }

    /// The time of the last progress: a request reads it rather than the clock, as it was
    /// marked a moment ago (when its head or its answer arrived).
    fn at(&self) -> u64 {
        self.at_ms.load(Ordering::Relaxed)
    }
}

/// One timer per connection that resolves when the connection made no progress for a bound. It is
/// moved only when it fires (or must fire sooner): arming a timer per request would cost a driver
/// wake-up each time.
pub(super) struct Watchdog {
    sleep: Pin<Box<tokio::time::Sleep>>,
    /// The instant the clock read `base_ms`.
    base: tokio::time::Instant,
    base_ms: u64,
}

impl Watchdog {
    pub(super) fn new(progress: &Progress<'_>, first_ms: u64) -> Self {
        let sleep = Box::pin(tokio::time::sleep(Duration::from_millis(first_ms)));
        let base = sleep.deadline() - Duration::from_millis(first_ms);
        Self {
            sleep,
            base,
            base_ms: progress.at_ms.load(Ordering::Relaxed),
        }
    }

    /// Resolves once `limit_ms` pass without progress.
    pub(super) async fn expired(&mut self, progress: &Progress<'_>, limit_ms: u64) {
        // A tighter bound than the timer's takes effect now; a looser one when the timer fires.
        let due_ms = progress.at_ms.load(Ordering::Relaxed) + limit_ms;
        let due = self.base + Duration::from_millis(due_ms.saturating_sub(self.base_ms));
        if due < self.sleep.deadline() {
            self.sleep.as_mut().reset(due);
        }
        loop {
            self.sleep.as_mut().await;
            let now_ms = progress.clock.now_ms();
            let due_ms = progress.at_ms.load(Ordering::Relaxed) + limit_ms;
            if now_ms >= due_ms {
                return;
            }
            let next = self.sleep.deadline() + Duration::from_millis(due_ms - now_ms);
            self.sleep.as_mut().reset(next);
        }
    }
}

/// Why a response could not be relayed.
struct RelayError {
    /// Whether anything was read from the backend.
    got_any: bool,
    /// The client broke the request (its body ended early or was malformed).
    client_fault: bool,
    /// The client left before the answer was done.
    client_gone: bool,
    /// The replica did not begin its answer within the route's `response_timeout_ms`.
    timed_out: bool,
    message: String,
}

impl RelayError {
    fn backend(got_any: bool, message: String) -> Self {
        Self {
            got_any,
            client_fault: false,
            client_gone: false,
            timed_out: false,
            message,
        }
    }

    fn gone() -> Self {
        Self {
            got_any: true,
            client_fault: false,
            client_gone: true,
            timed_out: false,
            message: "the client left".into(),
        }
    }

    fn response_timeout(ms: u64) -> Self {
        Self {
            got_any: false,
            client_fault: false,
            client_gone: false,
            timed_out: true,
            message: format!(
                "the replica did not begin its answer within {ms} ms (response_timeout_ms)"
            ),
        }
    }
}

/// What became of a relayed response.
struct Relayed {
    /// The backend connection can carry another request.
    backend_reusable: bool,
    /// The client connection must end (the response was delimited by the backend's close, or
    /// ended before the request body).
    client_close: bool,
}

impl Relayed {
    /// A response relayed while the request body was not all sent: neither connection can carry
    /// another request.
    fn before_the_body_ended(self) -> Self {
        Self {
            backend_reusable: false,
            client_close: true,
        }
    }
}

/// How much a client may send (a pipelined request, the request's body) while its request waits
/// for a replica, a connection or the answer: read ahead to notice the client leaving, no more.
const READ_AHEAD: usize = 64 * 1024;

/// Resolves when the client has gone: its connection reached its end or failed. Bytes that arrive
/// meanwhile are kept in `buf`, up to [`READ_AHEAD`]; past that it stops reading (and so never
/// resolves).
async fn client_gone<R: AsyncRead + Unpin>(cr: &mut R, buf: &mut BytesMut) {
    loop {
        if buf.len() >= READ_AHEAD {
            return std::future::pending().await;
        }
        buf.reserve(READ_AHEAD - buf.len());
        match cr.read_buf(buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Forwards one request and relays its response. Returns whether the client connection can carry
/// another request. A client that leaves before its answer is complete abandons the request at
/// once, wherever it is (held, waiting for a connection, waiting for the answer): its backend
/// connection is closed and it no longer counts as in flight.
#[allow(clippy::too_many_arguments)]
async fn exchange(
    proxy: &Proxy,
    entry: &Target,
    client: &mut TcpStream,
    buf: &mut BytesMut,
    head: &[u8],
    req: &Request,
    out: &mut Vec<u8>,
    progress: &Progress<'_>,
    span: Option<&opentelemetry::Context>,
) -> bool {
    let _in_flight = entry.traffic().begin(progress.at());
    progress.wrote.store(false, Ordering::Relaxed);
    progress.status.store(0, Ordering::Relaxed);
    progress.rtt_us.store(0, Ordering::Relaxed);
    let has_body = req.body != Framing::Empty;
    let (mut cr, mut cw) = client.split();
    let mut avoid: Option<SocketAddr> = None;
    let mut pooled_allowed = true;
    loop {
        let ready = async {
            progress.held.store(true, Ordering::Relaxed);
            let slot = entry
                .endpoint(
                    proxy,
                    avoid,
                    req.key,
                    &head[req.id.clone()],
                    req.wants_page,
                    span,
                )
                .await;
            progress.held.store(false, Ordering::Relaxed);
            let slot = slot?;
            let (replica, dial) = (slot.replica(), proxy.dial());
            let conn = backend_conn(replica, pooled_allowed, has_body, progress.at(), dial).await;
            Ok::<_, Refusal>((slot, conn))
        };
        let (slot, conn) = tokio::select! {
            r = ready => match r {
                Ok(got) => got,
                Err(refusal) => {
                    entry.traffic().answered(refusal.status.as_u16(), None);
                    progress.answered(refusal.status.as_u16());
                    return write_refusal(&mut cw, out, proxy, &refusal, has_body)
                        .await
                        .is_ok()
                        && !has_body;
                }
            },
            () = client_gone(&mut cr, buf) => {
                tracing::debug!(route = %entry.spec().name, "the client left while its request waited");
                return false;
            }
        };
        let addr = slot.addr();
        super::trace::replica(span, addr);
        let (mut backend, reused, opening) = match conn {
            Ok((backend, reused, opening)) => {
                if !reused {
                    // A new connection may have taken a while.
                    progress.mark();
                }
                (backend, reused, opening)
            }
            Err(e)
                if e.kind() == io::ErrorKind::ConnectionRefused
                    && super::retry_after_miss(super::BackendMiss::Refused, avoid.is_some()) =>
            {
                // Refused: the replica is stopping or gone. The request is untouched.
                tracing::debug!(route = %entry.spec().name, %addr, error = %e, "backend refused; retrying");
                slot.failed();
                avoid = Some(addr);
                continue;
            }
            Err(e) => {
                slot.failed();
                let refusal = Refusal::bad_gateway(format!("backend {addr}: {e}"));
                entry.traffic().answered(refusal.status.as_u16(), None);
                progress.answered(refusal.status.as_u16());
                return write_refusal(&mut cw, out, proxy, &refusal, has_body)
                    .await
                    .is_ok()
                    && !has_body;
            }
        };
        // Whether anything went to the client for this request (the connection's flag, which
        // the stream-idle bound reads too).
        let wrote = &progress.wrote;
        wrote.store(false, Ordering::Relaxed);
        let counted = AtomicBool::new(false);
        // A new connection holds its opening until it answers or settles.
        let opening = opening.map(Opening::settling);
        let opening = opening.as_ref();
        let response_ms = entry.spec().response_timeout_ms;
        // Resolves once the route's response timeout passed without the answer's head.
        let head_late = async {
            if response_ms == 0 {
                return std::future::pending().await;
            }
            tokio::time::sleep(Duration::from_millis(response_ms)).await;
            if counted.load(Ordering::Relaxed) {
                std::future::pending::<()>().await;
            }
        };
        let relayed = async {
            if has_body {
                relay_with_body(
                    &mut cr,
                    &mut cw,
                    buf,
                    &mut backend,
                    head,
                    req,
                    out,
                    wrote,
                    progress,
                    opening,
                    &slot,
                    &counted,
                    proxy.is_draining(),
                )
                .await
            } else {
                let Backend { stream, buf: bbuf } = &mut backend;
                let (mut br, mut bw) = stream.split();
                let relay = async {
                    bw.write_all(head)
                        .await
                        .map_err(|e| RelayError::backend(false, e.to_string()))?;
                    let to = Relay {
                        out: &mut *out,
                        wrote,
                        progress,
                        is_head: req.is_head,
                        client_wants_close: req.close || proxy.is_draining(),
                        opening,
                        slot: &slot,
                        traffic: entry.traffic(),
                        changes: entry.response_changes(),
                        counted: &counted,
                    };
                    relay_response(&mut br, bbuf, &mut cw, to).await
                };
                tokio::select! {
                    r = relay => r,
                    () = client_gone(&mut cr, buf) => Err(RelayError::gone()),
                }
            }
        };
        let result = tokio::select! {
            biased;
            r = relayed => r,
            () = head_late => Err(RelayError::response_timeout(response_ms)),
        };
        let wrote = wrote.load(Ordering::Relaxed);
        match result {
            Ok(r) => {
                if r.backend_reusable {
                    let d = proxy.dial();
                    pool_put(addr, backend, progress.at(), d.max_idle, d.idle_timeout_ms);
                }
                return !r.client_close;
            }
            Err(e) if e.client_gone => {
                tracing::debug!(route = %entry.spec().name, %addr, "the client left before its answer was done");
                return false;
            }
            Err(e) if e.timed_out => {
                // The backend connection is dropped (its answer may still come); the client gets
                // a 504, and its connection ends when it sent a body nobody finished reading.
                entry.traffic().timed_out(super::traffic::Timeout::Response);
                tracing::debug!(route = %entry.spec().name, %addr, "{}", e.message);
                let refusal =
                    Refusal::new(StatusCode::GATEWAY_TIMEOUT, "response_timeout", e.message);
                entry.traffic().answered(refusal.status.as_u16(), None);
                progress.answered(refusal.status.as_u16());
                if wrote {
                    return false;
                }
                return write_refusal(&mut cw, out, proxy, &refusal, has_body)
                    .await
                    .is_ok()
                    && !has_body;
            }
            Err(e) if !wrote && !e.got_any && !has_body && reused && pooled_allowed => {
                // A pooled connection the backend closed while it sat idle: the request did not
                // reach the app. Once more on a fresh connection.
                tracing::debug!(%addr, error = %e.message, "pooled backend connection was closed; retrying");
                pooled_allowed = false;
            }
            Err(e)
                if !wrote
                    && !e.got_any
                    && super::retry_after_miss(
                        super::BackendMiss::WentAway {
                            replayable: !has_body && req.idempotent,
                        },
                        avoid.is_some(),
                    ) =>
            {
                // The replica closed or reset a fresh connection without answering: it is
                // stopping.
                tracing::debug!(route = %entry.spec().name, %addr, error = %e.message, "backend went away; retrying");
                slot.failed();
                avoid = Some(addr);
            }
            Err(e) if !wrote => {
                if !e.client_fault {
                    slot.failed();
                }
                let refusal = if e.client_fault {
                    Refusal::new(StatusCode::BAD_REQUEST, "bad_request_body", e.message)
                } else {
                    Refusal::bad_gateway(format!("backend {addr}: {}", e.message))
                };
                if !counted.load(Ordering::Relaxed) {
                    entry.traffic().answered(refusal.status.as_u16(), None);
                    progress.answered(refusal.status.as_u16());
                }
                let _ = write_refusal(&mut cw, out, proxy, &refusal, true).await;
                return false;
            }
            Err(_) => return false,
        }
    }
}

/// A connection to `replica`: an idle pooled one of this thread (unless `pooled_allowed` is
/// false), or a new one opened within the replica's bound on openings. While neither can be had
/// the request waits for whichever comes first, an idle connection coming back or an opening
/// ending; `connect_timeout_ms` bounds it all. Whether the connection was pooled comes with it.
/// `check`: make sure a pooled connection is still open first (for a request with a body, which
/// cannot be sent again; a body-less one meeting a closed pooled connection is retried instead,
/// which saves a system call per request).
/// The general path's HTTP/1.1 hop takes its connections here too ([`super::h1hop`]).
pub(super) async fn backend_conn(
    replica: &Arc<Replica>,
    pooled_allowed: bool,
    check: bool,
    now_ms: u64,
    dial: Dial<'_>,
) -> io::Result<(Backend, bool, Option<Opening>)> {
    let addr = replica.addr;
    let idle_ms = dial.idle_timeout_ms;
    if pooled_allowed && let Some(b) = pool_take(addr, now_ms, idle_ms, check) {
        return Ok((b, true, None));
    }
    let take = || {
        pooled_allowed
            .then(|| pool_take(addr, dial.clock.now_ms(), idle_ms, check))
            .flatten()
    };
    let got = backends::get_connection(
        replica,
        &pool_waiter(addr),
        take,
        dial.attempt_ms,
        dial.timeout_ms,
    )
    .await?;
    Ok(match got {
        backends::Got::Idle(b) => (b, true, None),
        backends::Got::New(stream, opening) => (Backend::new(stream), false, Some(opening)),
    })
}

/// A request body failed to go through.
enum SendError {
    /// Reading it from the client failed or it was malformed.
    Client(io::Error),
    /// Writing it to the backend failed.
    Backend(io::Error),
}

/// Sends a request body while relaying the response, as a backend may answer before the body is
/// done (or answer `100 Continue` first). A response that ends before the body was sent ends both
/// connections. Once the body is sent, a client that leaves abandons the request.
#[allow(clippy::too_many_arguments)]
async fn relay_with_body<R, W>(
    cr: &mut R,
    cw: &mut W,
    buf: &mut BytesMut,
    backend: &mut Backend,
    head: &[u8],
    req: &Request,
    out: &mut Vec<u8>,
    wrote: &AtomicBool,
    progress: &Progress<'_>,
    opening: Option<&Settling>,
    slot: &Slot,
    counted: &AtomicBool,
    draining: bool,
) -> Result<Relayed, RelayError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Backend { stream, buf: bbuf } = backend;
    let (mut br, mut bw) = stream.split();
    let to = Relay {
        out,
        wrote,
        progress,
        is_head: req.is_head,
        client_wants_close: req.close || draining,
        opening,
        slot,
        traffic: req.entry.traffic(),
        changes: req.entry.response_changes(),
        counted,
    };
    let recv = relay_response(&mut br, bbuf, cw, to);
    tokio::pin!(recv);
    // Whether all of the body went.
    let sent = {
        let send = async {
            bw.write_all(head).await.map_err(SendError::Backend)?;
            send_body(cr, buf, &mut bw, req.body, progress).await
        };
        tokio::pin!(send);
        tokio::select! {
            r = &mut send => match r {
                Ok(()) => true,
                Err(SendError::Client(e)) => {
                    return Err(RelayError { got_any: true, client_fault: true, client_gone: false, timed_out: false, message: e.to_string() });
                }
                // The backend stopped reading: it may have answered already (413, say).
                Err(SendError::Backend(e)) => {
                    tracing::debug!(error = %e, "the backend stopped reading the request body");
                    false
                }
            },
            r = &mut recv => return r.map(Relayed::before_the_body_ended),
        }
    };
    if !sent {
        return recv.await.map(Relayed::before_the_body_ended);
    }
    tokio::select! {
        r = &mut recv => r,
        () = client_gone(cr, buf) => Err(RelayError::gone()),
    }
}

/// Copies a request body from the client (bytes already read first) to the backend.
async fn send_body<R, W>(
    cr: &mut R,
    buf: &mut BytesMut,
    bw: &mut W,
    body: Framing,
    progress: &Progress<'_>,
) -> Result<(), SendError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut left = match body {
        Framing::Length(n) => n,
        _ => u64::MAX,
    };
    let mut chunked = (body == Framing::Chunked).then(Chunked::new);
    loop {
        let done = match &chunked {
            Some(c) => c.is_done(),
            None => left == 0,
        };
        if done {
            return Ok(());
        }
        if buf.is_empty() {
            buf.reserve(READ_CHUNK);
            match cr.read_buf(buf).await {
                Ok(0) => {
                    return Err(SendError::Client(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client closed inside the request body",
                    )));
                }
                Ok(_) => progress.mark(),
                Err(e) => return Err(SendError::Client(e)),
            }
        }
        let take = match &mut chunked {
            Some(c) => c
                .advance(buf)
                .map_err(|e| SendError::Client(io::Error::new(io::ErrorKind::InvalidData, e)))?,
            None => usize::try_from(left).unwrap_or(usize::MAX).min(buf.len()),
        };
        bw.write_all(&buf[..take])
            .await
            .map_err(SendError::Backend)?;
        buf.advance(take);
        left = left.saturating_sub(take as u64);
    }
}

/// Where a response goes and what the request said about it.
struct Relay<'a, 'c> {
    out: &'a mut Vec<u8>,
    /// Set once anything was written to the client.
    wrote: &'a AtomicBool,
    progress: &'a Progress<'c>,
    is_head: bool,
    client_wants_close: bool,
    /// A new connection's opening, ended by the first byte of its answer.
    opening: Option<&'a Settling>,
    /// The request's slot, told of the answer's head.
    slot: &'a Slot,
    /// The route's traffic, which counts the answer.
    traffic: &'a Arc<super::RouteTraffic>,
    /// A meta service rule's changes to the answer's headers.
    changes: Option<&'a ebb_core::discovery::meta::Changes>,
    /// Set once the answer's head was counted: a failure after it is not another answer.
    counted: &'a AtomicBool,
}

/// Reads the backend's response and writes it to the client.
async fn relay_response<R, W>(
    br: &mut R,
    bbuf: &mut BytesMut,
    cw: &mut W,
    to: Relay<'_, '_>,
) -> Result<Relayed, RelayError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Relay {
        out,
        wrote,
        progress,
        is_head,
        client_wants_close,
        opening,
        slot,
        traffic,
        changes,
        counted,
    } = to;
    let mut got_any = false;
    loop {
        let resp = loop {
            if !bbuf.is_empty() {
                out.clear();
                match parse_response(bbuf, out, is_head, client_wants_close, changes) {
                    Ok(Some(r)) => break r,
                    Ok(None) if bbuf.len() >= MAX_HEAD => {
                        let message = "response head too large".into();
                        return Err(RelayError::backend(got_any, message));
                    }
                    Ok(None) => {}
                    Err(e) => return Err(RelayError::backend(got_any, e)),
                }
            }
            if bbuf.capacity() - bbuf.len() < 1024 {
                bbuf.reserve(8 * 1024);
            }
            match br.read_buf(bbuf).await {
                Ok(0) => {
                    let message = "backend closed the connection before answering".into();
                    return Err(RelayError::backend(got_any, message));
                }
                Ok(_) => {
                    if !got_any && let Some(o) = opening {
                        o.answered();
                    }
                    got_any = true;
                    progress.mark();
                }
                Err(e) => return Err(RelayError::backend(got_any, e.to_string())),
            }
        };
        bbuf.advance(resp.head_len);
        if !resp.interim {
            let rtt_us = slot.answered(resp.status, resp.load);
            traffic.answered(resp.status, Some(rtt_us));
            progress.answered(resp.status);
            progress.rtt_us.store(rtt_us.max(1), Ordering::Relaxed);
            counted.store(true, Ordering::Relaxed);
        }
        if resp.interim {
            if let Err(e) = cw.write_all(out).await {
                return Err(RelayError::backend(true, e.to_string()));
            }
            wrote.store(true, Ordering::Relaxed);
            continue;
        }
        let client_close = client_wants_close || resp.body == Framing::Close;
        let mut reusable = resp.backend_keep_alive && resp.body != Framing::Close;
        let mut left = match resp.body {
            Framing::Length(n) => n,
            Framing::Empty => 0,
            Framing::Chunked | Framing::Close => u64::MAX,
        };
        let mut chunked = (resp.body == Framing::Chunked).then(Chunked::new);
        let mut first = true;
        loop {
            if !first {
                let done = match &chunked {
                    Some(c) => c.is_done(),
                    None => resp.body != Framing::Close && left == 0,
                };
                if done {
                    break;
                }
                // Everything read so far went out; read the next piece of the body.
                bbuf.clear();
                bbuf.reserve(READ_CHUNK);
                match br.read_buf(bbuf).await {
                    Ok(0) if resp.body == Framing::Close => break,
                    Ok(0) => {
                        let message = "backend closed the connection inside the body".into();
                        return Err(RelayError::backend(true, message));
                    }
                    Ok(_) => progress.mark(),
                    Err(e) => return Err(RelayError::backend(true, e.to_string())),
                }
            }
            let take = match &mut chunked {
                Some(c) => c
                    .advance(bbuf)
                    .map_err(|e| RelayError::backend(true, e.to_string()))?,
                None => usize::try_from(left).unwrap_or(usize::MAX).min(bbuf.len()),
            };
            // The head goes out with the body bytes already read: one write for a small response.
            let write = if first {
                out.extend_from_slice(&bbuf[..take]);
                cw.write_all(out).await
            } else {
                cw.write_all(&bbuf[..take]).await
            };
            if let Err(e) = write {
                return Err(RelayError::backend(true, e.to_string()));
            }
            wrote.store(true, Ordering::Relaxed);
            bbuf.advance(take);
            left = left.saturating_sub(take as u64);
            first = false;
        }
        if !bbuf.is_empty() {
            // Bytes after the response: the backend broke the framing.
            reusable = false;
        }
        return Ok(Relayed {
            backend_reusable: reusable,
            client_close,
        });
    }
}

/// Where the fast path looks a request's Host up: the proxy's routes and meta services, or the
/// routes of the Gateway socket the connection came in on (looked up again for each request, so
/// a new compile applies to the next one).
struct Routing<'a> {
    proxy: &'a Proxy,
    gateway: Option<SocketAddr>,
    /// The span of the request whose head was parsed last (tracing on and the request sampled).
    span: std::cell::Cell<Option<opentelemetry::Context>>,
    /// The client, for the span.
    peer: SocketAddr,
}

impl Routing<'_> {
    /// The fast path's target for a request to meta service `service` under its matching rule,
    /// and the target sent on; None when the general path serves it.
    fn fast_service<'v>(
        &self,
        service: Arc<super::services::ServiceEntry>,
        host: &str,
        method: &str,
        target: &str,
        header: &dyn Fn(&str) -> Option<&'v [u8]>,
    ) -> Option<(Target, String)> {
        let (ri, sent) = service.meta.route(&crate::discovery::meta::RequestView {
            authority: &crate::ids::authority(host),
            method,
            target,
            header: &|n| header(n),
        })?;
        // gRPC goes on over HTTP/2: the general path's.
        let grpc = header("content-type").is_some_and(super::grpc::is_grpc_content_type);
        if !service.fast(ri) || grpc {
            return None;
        }
        let route = &service.meta.routes[ri];
        if route.total_weight() == 0 {
            return None;
        }
        let di = super::services::draw(route);
        let app = match route.destinations[di].app() {
            Some(a) => Some(self.proxy.table().named(a)?),
            None => None,
        };
        let target = ServiceTarget {
            service,
            route: ri,
            dest: di,
            app,
        };
        Some((Target::Service(Arc::new(target)), sent))
    }
}

impl Routes for Routing<'_> {
    type Route = Target;

    fn traces(&self) -> bool {
        super::trace::tracing().is_some()
    }

    fn trace(
        &self,
        route: &Target,
        method: &str,
        host: &str,
        path: &str,
        traceparent: Option<&[u8]>,
        tracestate: Option<&[u8]>,
        id: std::ops::Range<usize>,
        out: &mut Vec<u8>,
    ) {
        let Some(tracing) = super::trace::tracing() else {
            return;
        };
        let carried = super::trace::Carried {
            traceparent: traceparent.and_then(|v| std::str::from_utf8(v).ok()),
            tracestate: tracestate.and_then(|v| std::str::from_utf8(v).ok()),
        };
        let spec = route.spec();
        let cx = tracing.request(
            &carried,
            super::trace::RequestSpan {
                method,
                path,
                host,
                route: Some(&spec.name),
                client: Some(self.peer),
                request_id: Some(&out[id]),
            },
        );
        match &cx {
            Some(cx) => tracing.inject(cx, &mut super::trace::HeadLines(out)),
            None => {
                // Sampled out: the client's context goes on as it came.
                let carried = [
                    (&b"traceparent"[..], traceparent),
                    (&b"tracestate"[..], tracestate),
                ];
                for (name, value) in carried {
                    if let Some(v) = value {
                        ebb_http::h1::push_header(out, name, v);
                    }
                }
            }
        }
        self.span.set(cx);
    }

    fn spec(route: &Target) -> &RouteSpec {
        route.spec()
    }

    fn max_headers(&self) -> usize {
        self.proxy.options.limits.max_headers
    }

    fn max_head_bytes(&self) -> usize {
        self.proxy.options.limits.max_head_bytes
    }

    fn route(&self, host: &str) -> Option<Target> {
        self.proxy.route(host).map(Target::Route)
    }

    fn service<'v>(
        &self,
        host: &str,
        method: &str,
        target: &str,
        header: &dyn Fn(&str) -> Option<&'v [u8]>,
    ) -> ServiceMatch<Target> {
        let proxy = self.proxy;
        let service = match self.gateway {
            // On a Gateway socket every Host is the socket's: one it has no routes for is the
            // general path's to answer.
            Some(addr) => match proxy.gateway_socket(addr).and_then(|s| s.lookup(host)) {
                Some(s) => s,
                None => return ServiceMatch::Elsewhere,
            },
            None => match proxy.services.lookup(host) {
                Some(s) => s,
                None => return ServiceMatch::NotAService,
            },
        };
        match self.fast_service(service, host, method, target, header) {
            Some((target, sent)) => ServiceMatch::Fast(target, sent),
            None => ServiceMatch::Elsewhere,
        }
    }

    fn request_changes(
        route: &Target,
    ) -> (Option<&ebb_core::discovery::meta::Changes>, Option<&str>) {
        match route {
            Target::Route(_) => (None, None),
            Target::Service(s) => {
                let r = &s.service.meta.routes[s.route];
                (Some(&r.request_headers), r.rewrite_host.as_deref())
            }
        }
    }
}

/// Writes a refusal (404, 502, 503 ...) as a JSON error.
async fn write_refusal<W: AsyncWrite + Unpin>(
    client: &mut W,
    out: &mut Vec<u8>,
    proxy: &Proxy,
    refusal: &Refusal,
    close: bool,
) -> io::Result<()> {
    let json;
    let (body, content_type) = match &refusal.page {
        Some((html, _)) => (html.as_str(), &b"text/html; charset=utf-8"[..]),
        None => {
            json = refusal.json();
            (json.as_str(), &b"application/json"[..])
        }
    };
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    push_display(out, &refusal.status.as_u16());
    out.push(b' ');
    out.extend_from_slice(
        refusal
            .status
            .canonical_reason()
            .unwrap_or("Error")
            .as_bytes(),
    );
    out.extend_from_slice(b"\r\ncontent-type: ");
    out.extend_from_slice(content_type);
    out.extend_from_slice(b"\r\ncontent-length: ");
    push_display(out, &body.len());
    out.extend_from_slice(b"\r\n");
    if let Some((_, refresh_s)) = &refusal.page {
        out.extend_from_slice(b"cache-control: no-store\r\nrefresh: ");
        push_display(out, refresh_s);
        out.extend_from_slice(b"\r\n");
    }
    if refusal.retry_after {
        out.extend_from_slice(b"retry-after: ");
        push_display(out, &proxy.options.retry_after_s);
        out.extend_from_slice(b"\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body.as_bytes());
    client.write_all(out).await
}

impl Backend {
    pub(super) fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: BytesMut::with_capacity(8 * 1024),
        }
    }
}

/// Idle keep-alive backend connections of this thread, newest last, per backend, with the
/// signal that one came back for requests of this thread waiting for one.
#[derive(Default)]
struct Pool {
    /// By replica address (FNV: the keys are ebb's replicas, not a client's to choose).
    idle: HashMap<SocketAddr, Idle, fnv::FnvBuildHasher>,
    swept_at_ms: u64,
}

#[derive(Default)]
struct Idle {
    conns: Vec<(Backend, u64)>,
    /// Told when a connection comes back; present while a request may wait on it.
    returned: Option<Arc<Notify>>,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// The newest idle connection to `addr` that has not timed out; with `check`, one the backend has
/// closed (or written to out of turn) is dropped instead of returned.
pub(super) fn pool_take(
    addr: SocketAddr,
    now_ms: u64,
    idle_timeout_ms: u64,
    check: bool,
) -> Option<Backend> {
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        let conns = &mut p.idle.get_mut(&addr)?.conns;
        while let Some((b, since)) = conns.pop() {
            if now_ms.saturating_sub(since) >= idle_timeout_ms {
                // The rest are older still.
                conns.clear();
                break;
            }
            if check && !alive(&b.stream) {
                continue;
            }
            return Some(b);
        }
        None
    })
}

/// What tells this thread's requests waiting for a connection to `addr` that one came back.
fn pool_waiter(addr: SocketAddr) -> Arc<Notify> {
    POOL.with(|p| {
        p.borrow_mut()
            .idle
            .entry(addr)
            .or_default()
            .returned
            .get_or_insert_with(Default::default)
            .clone()
    })
}

/// Whether an idle connection is still open: nothing to read (no EOF, no stray bytes).
fn alive(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(stream.try_read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// Keeps an idle connection to `addr`: at most `max_idle` per backend (the oldest goes), each
/// for `idle_timeout_ms`.
pub(super) fn pool_put(
    addr: SocketAddr,
    b: Backend,
    now_ms: u64,
    max_idle: usize,
    idle_timeout_ms: u64,
) {
    if max_idle == 0 {
        return;
    }
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        if now_ms.saturating_sub(p.swept_at_ms) >= 1_000 {
            p.swept_at_ms = now_ms;
            let timeout = idle_timeout_ms;
            // Connections past their idle time, and those the backend closed (a replica that
            // stopped: its address may never be asked for again), are let go.
            p.idle.retain(|_, idle| {
                idle.conns.retain(|(b, since)| {
                    now_ms.saturating_sub(*since) < timeout && alive(&b.stream)
                });
                // Nobody waits on a signal only the pool still holds.
                if idle
                    .returned
                    .as_ref()
                    .is_some_and(|n| Arc::strong_count(n) == 1)
                {
                    idle.returned = None;
                }
                !idle.conns.is_empty() || idle.returned.is_some()
            });
        }
        let idle = p.idle.entry(addr).or_default();
        if idle.conns.len() >= max_idle {
            idle.conns.remove(0);
        }
        idle.conns.push((b, now_ms));
        if let Some(n) = &idle.returned {
            n.notify_one();
        }
    })
}

/// A connection with bytes already read from it, handed to the general path.
pub(super) struct Prefixed {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(out.remaining());
            out.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, out)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SimClock;
    use futures_util::FutureExt;

    async fn step(clock: &SimClock, ms: u64) {
        clock.advance(ms);
        tokio::time::advance(Duration::from_millis(ms)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn the_watchdog_fires_only_after_a_quiet_limit() {
        let clock = SimClock::new(1_000);
        let progress = Progress::new(&clock);
        let mut dog = Watchdog::new(&progress, 100);
        {
            let quiet = dog.expired(&progress, 100);
            tokio::pin!(quiet);
            assert!(quiet.as_mut().now_or_never().is_none());
            step(&clock, 60).await;
            progress.mark();
            step(&clock, 60).await;
            assert!(
                quiet.as_mut().now_or_never().is_none(),
                "60 ms since the last progress"
            );
            step(&clock, 40).await;
            assert!(quiet.as_mut().now_or_never().is_some());
        }
        // A looser bound waits longer; a tighter one after it takes effect at once.
        progress.mark();
        {
            let stall = dog.expired(&progress, 1_000);
            tokio::pin!(stall);
            step(&clock, 500).await;
            assert!(stall.as_mut().now_or_never().is_none());
        }
        progress.mark();
        let quiet = dog.expired(&progress, 100);
        tokio::pin!(quiet);
        assert!(quiet.as_mut().now_or_never().is_none());
        step(&clock, 100).await;
        assert!(quiet.as_mut().now_or_never().is_some());
    }
}
