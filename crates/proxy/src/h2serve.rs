//! Plain HTTP/2 (h2c) client connections, served on ebb's own HTTP/2 server side
//! ([`ebb_http::h2server`]) rather than hyper's: the connection's task reads the socket into the
//! server side, starts a task per request running [`Proxy::answer`] (what hyper's service runs),
//! and writes the answers those tasks hand back as the flow-control windows let them.
//!
//! Between the connection's task and a request's task:
//! - the request's body is a channel of the DATA the client sent; as the request's task reads
//!   it, it says so ([`Ctl::Consumed`]) and the connection gives the window back, so what waits
//!   in the channel is bounded by the windows this side gave (a stream's, the connection's);
//! - the answer comes back as messages on one channel per connection ([`Ctl`]): its head, its
//!   data, its trailers. Data past the first frame waits for credit from a budget per stream
//!   ([`ANSWER_BUDGET`]) that the connection returns as the data goes out, so what waits for a
//!   window is bounded too;
//! - a client's RST_STREAM aborts the request's task; the connection's end aborts them all.
//!
//! The connection closes once idle (no stream open) for the client idle timeout, and on
//! draining says GOAWAY and closes after the streams under way.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use ebb_http::h2::ErrorCode;
use ebb_http::h2server::{Config, Event, RequestHead, Server};
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::http::uri::{Authority, PathAndQuery, Scheme};
use hyper::{Method, Request, Uri};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::AbortHandle;

use super::h1::{Progress, Watchdog};
use super::h2parts::{self, Credit, Flushed, Waiting, header_map, release};
use super::{Body, BoxError, Proxy, gateway};

/// Bytes of one answer that may wait for the client's windows beyond its first DATA frame.
const ANSWER_BUDGET: usize = 256 * 1024;
/// Messages from the requests' tasks taken before the connection writes what they made.
const CTL_BATCH: usize = 64;
/// Bytes read from the client at once.
const READ_CHUNK: usize = 16 * 1024;

/// What a request's task tells its connection.
enum Ctl {
    /// The answer's head; `end`: it has no body.
    Head {
        stream: u32,
        status: u16,
        fields: HeaderMap,
        end: bool,
    },
    /// Part of the answer's body; `credit`: the budget it took, returned once it is out.
    Data {
        stream: u32,
        data: Bytes,
        end: bool,
        credit: Option<Credit>,
    },
    /// The answer's trailers, ending it.
    Trailers { stream: u32, fields: HeaderMap },
    /// The task ended without ending its answer (its body failed): the stream is reset.
    Gone { stream: u32 },
    /// `n` bytes of the request's body were read.
    Consumed { stream: u32, n: usize },
}

/// What goes into a request's body.
enum Part {
    Data(Bytes),
    Trailers(HeaderMap),
    /// The client reset the stream or the connection ended: the body is cut short.
    Cut,
}

/// A request under way on the connection.
struct Stream {
    /// Its body's sender, until the client ends the body.
    body: Option<mpsc::UnboundedSender<Part>>,
    task: AbortHandle,
    waiting: VecDeque<Waiting>,
}

/// A connection's requests, their tasks aborted when it ends.
#[derive(Default)]
struct Streams(HashMap<u32, Stream>);

impl Drop for Streams {
    fn drop(&mut self) {
        for (_, s) in self.0.drain() {
            if let Some(body) = s.body {
                let _ = body.send(Part::Cut);
            }
            s.task.abort();
            release(s.waiting);
        }
    }
}

/// Serves an h2c connection whose first bytes (the preface's start, at least) are `read`.
/// `gateway`: the plain Gateway socket it came in on.
pub(super) async fn serve(
    proxy: Arc<Proxy>,
    mut client: TcpStream,
    read: BytesMut,
    peer: SocketAddr,
    gateway: Option<SocketAddr>,
) {
    let limits = proxy.options.limits;
    let mut server = Server::new(Config {
        max_header_list_size: u32::try_from(limits.max_head_bytes).unwrap_or(u32::MAX),
        ..Config::default()
    });
    let (ctl, mut ctl_rx) = mpsc::unbounded_channel::<Ctl>();
    let mut streams = Streams::default();
    let mut events = Vec::new();
    let mut buf = read;
    let mut draining = false;
    let idle_ms = proxy.options.client_idle_timeout_ms;
    let progress = Progress::new(&*proxy.clock);
    // Until the first request, the client may be silent for the header-read timeout; from it
    // on, for the idle timeout while no request is open.
    let mut idle_limit_ms = limits.header_read_timeout_ms;
    let mut watchdog = Watchdog::new(&progress, idle_limit_ms);
    let mut open_before = false;
    let drained = proxy.drained();
    tokio::pin!(drained);
    loop {
        if !buf.is_empty() {
            let read = server.recv(&buf, &mut events);
            for event in events.drain(..) {
                on_event(
                    event,
                    &buf,
                    &mut server,
                    &mut streams,
                    &proxy,
                    &ctl,
                    peer,
                    gateway,
                );
            }
            match read {
                Ok(n) => buf.advance(n),
                Err(e) => {
                    tracing::debug!(%peer, error = ?e, "HTTP/2 connection error");
                    buf.clear();
                }
            }
        }
        if h2parts::write_out(&mut client, server.out()).await.is_err() {
            return;
        }
        if server.failed() || (draining && streams.0.is_empty()) {
            return;
        }
        if buf.capacity() - buf.len() < READ_CHUNK {
            buf.reserve(READ_CHUNK);
        }
        let idle = streams.0.is_empty();
        if idle && open_before {
            // The idle bound counts from the last answer's end.
            progress.mark();
        } else if !idle {
            // From the first request on, the bound between requests is the idle timeout.
            idle_limit_ms = idle_ms;
        }
        open_before = !idle;
        // Not biased: answers coming all the time must not leave the client's frames (its
        // WINDOW_UPDATEs, its new requests) unread.
        tokio::select! {
            Some(first) = ctl_rx.recv() => {
                on_ctl(first, &mut server, &mut streams);
                for _ in 1..CTL_BATCH {
                    match ctl_rx.try_recv() {
                        Ok(m) => on_ctl(m, &mut server, &mut streams),
                        Err(_) => break,
                    }
                }
            }
            r = client.read_buf(&mut buf) => match r {
                Ok(n) if n > 0 => {
                    if idle {
                        progress.mark();
                    }
                }
                _ => return,
            },
            () = &mut drained, if !draining => {
                draining = true;
                server.go_away();
            }
            () = watchdog.expired(&progress, idle_limit_ms), if idle => {
                server.go_away();
                let _ = client.write_all(server.out()).await;
                return;
            }
        }
    }
}

/// Takes one thing the server side read.
#[allow(clippy::too_many_arguments)]
fn on_event(
    event: Event,
    buf: &[u8],
    server: &mut Server,
    streams: &mut Streams,
    proxy: &Arc<Proxy>,
    ctl: &mpsc::UnboundedSender<Ctl>,
    peer: SocketAddr,
    gateway: Option<SocketAddr>,
) {
    match event {
        Event::Request {
            stream,
            head,
            end_stream,
        } => {
            let (body, tx) = if end_stream {
                (super::empty(), None)
            } else {
                let (tx, rx) = mpsc::unbounded_channel();
                let body = RequestBody {
                    rx,
                    stream,
                    ctl: ctl.clone(),
                    ended: false,
                };
                (body.boxed(), Some(tx))
            };
            let Some(mut req) = request(head, body) else {
                server.reset(stream, ErrorCode::PROTOCOL_ERROR);
                return;
            };
            if let Some(addr) = gateway {
                req.extensions_mut()
                    .insert(gateway::Socket { addr, sni: None });
            }
            let task = tokio::spawn(answer(proxy.clone(), req, peer, stream, ctl.clone()));
            streams.0.insert(
                stream,
                Stream {
                    body: tx,
                    task: task.abort_handle(),
                    waiting: VecDeque::new(),
                },
            );
        }
        Event::Data {
            stream,
            data,
            end_stream,
        } => {
            let n = data.len();
            let Some(s) = streams.0.get_mut(&stream) else {
                server.consumed(stream, n);
                return;
            };
            if n > 0 {
                let sent = s.body.as_ref().map(|tx| {
                    tx.send(Part::Data(Bytes::copy_from_slice(&buf[data])))
                        .is_ok()
                });
                if sent != Some(true) {
                    // Nobody reads the body any more: its window goes back at once.
                    server.consumed(stream, n);
                }
            }
            if end_stream {
                s.body = None;
            }
        }
        Event::Trailers { stream, fields } => {
            if let Some(tx) = streams.0.get_mut(&stream).and_then(|s| s.body.take()) {
                let _ = tx.send(Part::Trailers(header_map(fields)));
            }
        }
        Event::Reset { stream, .. } => {
            if let Some(s) = streams.0.remove(&stream) {
                if let Some(body) = s.body {
                    let _ = body.send(Part::Cut);
                }
                s.task.abort();
                release(s.waiting);
            }
        }
        Event::Writable { stream: 0 } => {
            let ready: Vec<u32> = streams
                .0
                .iter()
                .filter(|(_, s)| !s.waiting.is_empty())
                .map(|(id, _)| *id)
                .collect();
            for stream in ready {
                flush(server, streams, stream);
            }
        }
        Event::Writable { stream } => flush(server, streams, stream),
        // The open requests may finish; no new ones come (the server side refuses them).
        Event::GoAway { .. } => {}
    }
}

/// Takes one message of a request's task.
fn on_ctl(m: Ctl, server: &mut Server, streams: &mut Streams) {
    match m {
        Ctl::Head {
            stream,
            status,
            fields,
            end,
        } => {
            let fields = fields
                .iter()
                .filter(|(n, v)| {
                    !ebb_http::h2::connection_specific(n.as_str().as_bytes(), v.as_bytes())
                })
                .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
            if server.respond(stream, status, fields, end).is_ok() && end {
                done(server, streams, stream);
            }
        }
        Ctl::Data {
            stream,
            data,
            end,
            credit,
        } => match streams.0.get_mut(&stream) {
            Some(s) => {
                s.waiting.push_back(Waiting::Data { data, end, credit });
                flush(server, streams, stream);
            }
            None => release(VecDeque::from([Waiting::Data { data, end, credit }])),
        },
        Ctl::Trailers { stream, fields } => {
            if let Some(s) = streams.0.get_mut(&stream) {
                s.waiting.push_back(Waiting::Trailers(fields));
                flush(server, streams, stream);
            }
        }
        Ctl::Gone { stream } => {
            if let Some(s) = streams.0.remove(&stream) {
                release(s.waiting);
                server.reset(stream, ErrorCode::INTERNAL_ERROR);
            }
        }
        Ctl::Consumed { stream, n } => server.consumed(stream, n),
    }
}

/// Writes what of `stream`'s answer the windows let go.
fn flush(server: &mut Server, streams: &mut Streams, stream: u32) {
    let Some(s) = streams.0.get_mut(&stream) else {
        return;
    };
    match h2parts::flush(server, stream, &mut s.waiting) {
        Flushed::Waiting => {}
        Flushed::Ended => done(server, streams, stream),
        Flushed::Gone => {
            if let Some(s) = streams.0.remove(&stream) {
                release(s.waiting);
            }
        }
    }
}

/// `stream`'s answer is whole: a request body still coming is not wanted (RST_STREAM with
/// NO_ERROR, RFC 9113 8.1).
fn done(server: &mut Server, streams: &mut Streams, stream: u32) {
    if let Some(s) = streams.0.remove(&stream) {
        release(s.waiting);
        if let Some(body) = s.body {
            let _ = body.send(Part::Cut);
            server.reset(stream, ErrorCode::NO_ERROR);
        }
    }
}

/// The request as [`Proxy::answer`] takes it, or `None` when its head does not make one.
fn request(head: RequestHead, body: Body) -> Option<Request<Body>> {
    let method = Method::from_bytes(&head.method).ok()?;
    let mut parts = hyper::http::uri::Parts::default();
    if !head.authority.is_empty() {
        parts.authority = Some(Authority::from_maybe_shared(Bytes::from(head.authority)).ok()?);
    }
    if method != Method::CONNECT {
        parts.path_and_query = Some(PathAndQuery::from_maybe_shared(Bytes::from(head.path)).ok()?);
        if parts.authority.is_some() {
            parts.scheme = Some(Scheme::try_from(head.scheme.as_slice()).ok()?);
        }
    }
    let uri = Uri::from_parts(parts).ok()?;
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = hyper::Version::HTTP_2;
    let headers = req.headers_mut();
    headers.reserve(head.fields.len());
    for (name, value) in head.fields {
        let name = HeaderName::from_bytes(&name).ok()?;
        let value = HeaderValue::from_maybe_shared(Bytes::from(value)).ok()?;
        headers.append(name, value);
    }
    Some(req)
}

/// Ends a request's answer as reset when its task ends before the answer does.
struct Unfinished {
    ctl: mpsc::UnboundedSender<Ctl>,
    stream: u32,
    finished: bool,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.ctl.send(Ctl::Gone {
                stream: self.stream,
            });
        }
    }
}

/// A request's task: its answer, handed back to the connection head, data and trailers.
async fn answer(
    proxy: Arc<Proxy>,
    req: Request<Body>,
    peer: SocketAddr,
    stream: u32,
    ctl: mpsc::UnboundedSender<Ctl>,
) {
    let mut guard = Unfinished {
        ctl,
        stream,
        finished: false,
    };
    let resp = proxy.answer(req, peer).await;
    let (parts, mut body) = resp.into_parts();
    let end = body.is_end_stream();
    let _ = guard.ctl.send(Ctl::Head {
        stream,
        status: parts.status.as_u16(),
        fields: parts.headers,
        end,
    });
    if end {
        guard.finished = true;
        return;
    }
    let mut budget: Option<Arc<Semaphore>> = None;
    let mut first = true;
    loop {
        let frame = match body.frame().await {
            None => {
                let _ = guard.ctl.send(Ctl::Data {
                    stream,
                    data: Bytes::new(),
                    end: true,
                    credit: None,
                });
                guard.finished = true;
                return;
            }
            Some(Ok(frame)) => frame,
            Some(Err(e)) => {
                tracing::debug!(%peer, error = %e, "an answer's body failed; resetting its stream");
                return;
            }
        };
        let frame = match frame.into_data() {
            Ok(data) => {
                let end = body.is_end_stream();
                let credit = if std::mem::take(&mut first) {
                    None
                } else {
                    let budget = budget
                        .get_or_insert_with(|| Arc::new(Semaphore::new(ANSWER_BUDGET)))
                        .clone();
                    let n = data.len().clamp(1, ANSWER_BUDGET) as u32;
                    let Ok(permits) = budget.acquire_many(n).await else {
                        return;
                    };
                    permits.forget();
                    Some((budget, n))
                };
                let _ = guard.ctl.send(Ctl::Data {
                    stream,
                    data,
                    end,
                    credit,
                });
                if end {
                    guard.finished = true;
                    return;
                }
                continue;
            }
            Err(frame) => frame,
        };
        if let Ok(fields) = frame.into_trailers() {
            let _ = guard.ctl.send(Ctl::Trailers { stream, fields });
            guard.finished = true;
            return;
        }
    }
}

/// A request's body: the DATA its client sent, each part's window given back as it is read.
struct RequestBody {
    rx: mpsc::UnboundedReceiver<Part>,
    stream: u32,
    ctl: mpsc::UnboundedSender<Ctl>,
    ended: bool,
}

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Part::Data(data))) => {
                let _ = self.ctl.send(Ctl::Consumed {
                    stream: self.stream,
                    n: data.len(),
                });
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Part::Trailers(fields))) => {
                self.ended = true;
                Poll::Ready(Some(Ok(Frame::trailers(fields))))
            }
            Poll::Ready(Some(Part::Cut)) => {
                self.ended = true;
                Poll::Ready(Some(Err("the client reset the request".into())))
            }
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        // What was sent and never read gives its window back, and nothing more is taken.
        let n = h2parts::unread(&mut self.rx, |part| match part {
            Part::Data(data) => data.len(),
            _ => 0,
        });
        if n > 0 {
            let _ = self.ctl.send(Ctl::Consumed {
                stream: self.stream,
                n,
            });
        }
    }
}
