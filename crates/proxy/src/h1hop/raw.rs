//! ebb's own HTTP/1.1 exchange for the general path's body-less requests (see [`super`]): the
//! request's head written from its parts, the answer's head parsed into a [`Response`], its body
//! decoded as it is polled, on the fast path's backend connections and pool.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use ebb_http::chunked::Chunked;
use ebb_http::h1::{Framing, MAX_HEADERS, parse_response_head, push_header};

use super::super::backends::{self, Backends, Dial, Settling};
use super::super::h1::{Backend, backend_conn, pool_put, pool_take};
use super::super::{Body, BoxError, RawError, SendError as Error};
use crate::clock::Clock;

/// Whether `req` is exchanged here: it has no body and asks for no upgrade.
pub fn takes(req: &Request<Body>) -> bool {
    use hyper::body::Body as _;
    req.body().is_end_stream()
        && req.method() != Method::CONNECT
        && !req.headers().contains_key(hyper::header::UPGRADE)
}

/// Sends `req` (body-less, its URI the origin form, its `Host` set) to `addr` and reads the
/// answer's head. When no connection could be made the request comes back whole
/// ([`Error::unsent`]), and when the replica went away before answering its head comes back
/// ([`Error::Gone`]): the caller keeps no copy of it for another try.
pub async fn send(
    req: Request<Body>,
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
) -> Result<Response<Body>, Error> {
    let (parts, body) = req.into_parts();
    let is_head = parts.method == Method::HEAD;
    let head = request_head(&parts);
    let max_head = usize::try_from(dial.max_header_list_size).unwrap_or(usize::MAX);
    let mut pooled_allowed = true;
    loop {
        let (mut b, pooled, settling) = match conn(addr, dial, backends, pooled_allowed).await {
            Ok(c) => c,
            Err(e) => return Err(e.unsent(Request::from_parts(parts, body))),
        };
        let answer = match exchange(&mut b, &head, is_head, max_head).await {
            Ok(a) => a,
            // A pooled connection the replica closed while it sat idle: the request was not
            // processed. Once more, on a fresh one.
            Err((e, false)) if pooled && e.went_away() => {
                tracing::debug!(%addr, error = %e, "pooled connection to a replica was closed; retrying");
                pooled_allowed = false;
                continue;
            }
            Err((e, _)) if e.went_away() => return Err(Error::Gone(e, Some(Box::new(parts)))),
            Err((e, _)) => return Err(Error::Raw(e)),
        };
        if let Some(s) = &settling {
            s.answered();
        }
        let Answer {
            version,
            status,
            headers,
            framing,
            keep_alive,
        } = answer;
        let mut body = AnswerBody {
            conn: Some(b),
            left: match framing {
                Framing::Length(n) => Left::Length(n),
                Framing::Chunked => Left::Chunked(Chunked::new(), Vec::new()),
                Framing::Close => Left::Close,
                Framing::Empty => Left::Length(0),
            },
            keep_alive,
            addr,
            max_idle: dial.max_idle,
            idle_timeout_ms: dial.idle_timeout_ms,
            clock: dial.clock.clone(),
        };
        if framing == Framing::Empty {
            body.ended();
        }
        let mut response = Response::new(body.boxed());
        *response.version_mut() = version;
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        return Ok(response);
    }
}

/// The request's head: what hyper's client writes for a request without a body (its headers as
/// they are, but no `Transfer-Encoding`).
fn request_head(parts: &hyper::http::request::Parts) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if name != hyper::header::TRANSFER_ENCODING {
            push_header(&mut out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// A connection to `addr`: an idle pooled one of this thread (unless `pooled_allowed` is false),
/// else as the fast path gets one for a replica ([`backend_conn`]: a new one within the
/// replica's bound on openings, with its opening to end at the first answer, or whichever of
/// those comes first). Whether it was pooled comes with it.
async fn conn(
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
    pooled_allowed: bool,
) -> Result<(Backend, bool, Option<Settling>), Error> {
    let now = dial.clock.now_ms();
    if pooled_allowed && let Some(b) = pool_take(addr, now, dial.idle_timeout_ms, false) {
        return Ok((b, true, None));
    }
    // The wait and the opening are a future of their own, boxed, so that every request's state
    // does not carry theirs.
    Box::pin(async move {
        let Some(replica) = backends.find(addr) else {
            // An address no ready list names is not paced.
            let stream = backends::connect(addr, dial.attempt_ms, dial.timeout_ms, None)
                .await
                .map_err(Error::connect)?;
            return Ok((Backend::new(stream), false, None));
        };
        let (b, pooled, opening) = backend_conn(&replica, pooled_allowed, false, now, dial)
            .await
            .map_err(Error::connect)?;
        Ok((b, pooled, opening.map(backends::Opening::settling)))
    })
    .await
}

/// An answer's head, read.
struct Answer {
    version: hyper::Version,
    status: StatusCode,
    headers: HeaderMap,
    framing: Framing,
    keep_alive: bool,
}

/// Writes `head` and reads the answer's head (skipping interim 1xx ones), leaving the bytes after
/// it in the connection's buffer. An error says whether any byte of an answer came.
async fn exchange(
    b: &mut Backend,
    head: &[u8],
    is_head: bool,
    max_head: usize,
) -> Result<Answer, (RawError, bool)> {
    if let Err(e) = b.stream.write_all(head).await {
        return Err((e.into(), false));
    }
    // A connection's buffer is empty when it is handed out: the pool keeps only such ones.
    let mut got_any = false;
    loop {
        if !b.buf.is_empty() {
            match parse(&b.buf, is_head) {
                Ok(Some((len, None))) => {
                    // An interim answer: the final one follows.
                    b.buf.advance(len);
                    continue;
                }
                Ok(Some((len, Some(answer)))) => {
                    b.buf.advance(len);
                    return Ok(answer);
                }
                Ok(None) if b.buf.len() >= max_head => {
                    let e = format!("the answer's head is over {max_head} bytes");
                    return Err((RawError::Malformed(e), true));
                }
                Ok(None) => {}
                Err(e) => return Err((RawError::Malformed(e), true)),
            }
        }
        if b.buf.capacity() - b.buf.len() < 1024 {
            b.buf.reserve(8 * 1024);
        }
        match b.stream.read_buf(&mut b.buf).await {
            Ok(0) if got_any => {
                let e = std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the replica closed the connection inside the answer's head",
                );
                return Err((e.into(), true));
            }
            Ok(0) => return Err((RawError::Closed, false)),
            Ok(_) => got_any = true,
            Err(e) => return Err((e.into(), got_any)),
        }
    }
}

/// Parses an answer's head at the start of `buf`: `None` when more bytes are needed, else its
/// length and the answer (`None` for an interim one).
fn parse(buf: &[u8], is_head: bool) -> Result<Option<(usize, Option<Answer>)>, String> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let Some((len, resp, head)) = parse_response_head(buf, &mut fields, is_head)? else {
        return Ok(None);
    };
    if head.interim {
        return Ok(Some((len, None)));
    }
    let status = StatusCode::from_u16(head.code).map_err(|e| e.to_string())?;
    let mut headers = HeaderMap::with_capacity(resp.headers.len());
    for h in resp.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| format!("invalid header name {:?} in the response", h.name))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| format!("invalid value of {} in the response", h.name))?;
        headers.append(name, value);
    }
    Ok(Some((
        len,
        Some(Answer {
            version: if head.version == 0 {
                hyper::Version::HTTP_10
            } else {
                hyper::Version::HTTP_11
            },
            status,
            headers,
            framing: head.body,
            keep_alive: head.keep_alive,
        }),
    )))
}

/// What is left of an answer's body.
enum Left {
    /// This many bytes.
    Length(u64),
    /// Chunks, up to the end of the trailer section (whose bytes are gathered here).
    Chunked(Chunked, Vec<u8>),
    /// Everything until the replica closes the connection.
    Close,
}

/// An answer's body, read from its connection as it is polled; the connection goes back to the
/// pool once the body is read to its end (and is closed if it is dropped before).
struct AnswerBody {
    /// `None` once the body ended.
    conn: Option<Backend>,
    left: Left,
    keep_alive: bool,
    addr: SocketAddr,
    max_idle: usize,
    idle_timeout_ms: u64,
    clock: Arc<dyn Clock>,
}

impl AnswerBody {
    /// The body is read to its end (by its framing; one read to the replica's close has no
    /// connection left): its connection is kept if it may carry another request and the replica
    /// sent nothing past the answer.
    fn ended(&mut self) {
        if let Some(b) = self.conn.take()
            && self.keep_alive
            && b.buf.is_empty()
        {
            let now = self.clock.now_ms();
            pool_put(self.addr, b, now, self.max_idle, self.idle_timeout_ms);
        }
    }

    /// The next frame from the bytes read so far, if they make one: `Err` for a malformed body.
    fn frame(&mut self) -> Result<Option<Frame<Bytes>>, BoxError> {
        let Some(b) = self.conn.as_mut() else {
            return Ok(None);
        };
        match &mut self.left {
            Left::Length(n) => {
                let take = usize::try_from(*n).unwrap_or(usize::MAX).min(b.buf.len());
                if take == 0 {
                    return Ok(None);
                }
                let data = b.buf.split_to(take).freeze();
                *n -= take as u64;
                if *n == 0 {
                    self.ended();
                }
                Ok(Some(Frame::data(data)))
            }
            Left::Close if b.buf.is_empty() => Ok(None),
            Left::Close => Ok(Some(Frame::data(b.buf.split().freeze()))),
            Left::Chunked(chunked, trailers) => loop {
                if b.buf.is_empty() {
                    return Ok(None);
                }
                let d = chunked.decode(&b.buf)?;
                trailers.extend_from_slice(&b.buf[d.trailers.clone()]);
                if !d.data.is_empty() {
                    b.buf.advance(d.data.start);
                    let data = b.buf.split_to(d.data.len()).freeze();
                    return Ok(Some(Frame::data(data)));
                }
                b.buf.advance(d.consumed);
                if chunked.is_done() {
                    let fields = parse_trailers(trailers)?;
                    self.ended();
                    return Ok(fields.map(Frame::trailers));
                }
                if d.consumed == 0 {
                    return Ok(None);
                }
            },
        }
    }
}

/// A chunked body's trailer section (up to and with its final empty line), as fields; `None`
/// when it has none.
fn parse_trailers(bytes: &[u8]) -> Result<Option<HeaderMap>, BoxError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let parsed = match httparse::parse_headers(bytes, &mut fields) {
        Ok(httparse::Status::Complete((_, parsed))) => parsed,
        Ok(httparse::Status::Partial) => return Err("a chunked body's trailers are cut".into()),
        Err(e) => return Err(format!("malformed trailers in a chunked body: {e}").into()),
    };
    if parsed.is_empty() {
        return Ok(None);
    }
    let mut map = HeaderMap::with_capacity(parsed.len());
    for h in parsed {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return Err(format!("invalid trailer field {:?}", h.name).into());
        };
        map.append(name, value);
    }
    Ok(Some(map))
}

impl hyper::body::Body for AnswerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            match this.frame() {
                Ok(Some(f)) => return Poll::Ready(Some(Ok(f))),
                Ok(None) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e)));
                }
            }
            let Some(b) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            if b.buf.capacity() - b.buf.len() < 1024 {
                b.buf.reserve(16 * 1024);
            }
            let read = match b.stream.try_read_buf(&mut b.buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Err(e) = ready!(b.stream.poll_read_ready(cx)) {
                        this.conn = None;
                        return Poll::Ready(Some(Err(e.into())));
                    }
                    continue;
                }
                r => r,
            };
            match read {
                Ok(0) if matches!(this.left, Left::Close) => {
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.conn = None;
                    let e = "the replica closed the connection inside the answer's body";
                    return Poll::Ready(Some(Err(e.into())));
                }
                Ok(_) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.conn, &self.left) {
            (None, _) => SizeHint::with_exact(0),
            (Some(_), Left::Length(n)) => SizeHint::with_exact(*n),
            _ => SizeHint::default(),
        }
    }
}
