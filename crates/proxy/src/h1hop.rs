//! The general path's HTTP/1.1 hop to replicas (the requests of HTTP/2 clients and of HTTP/1.0
//! ones, upgrades).
//!
//! A request without a body that asks for no upgrade (most of them: GETs, HEADs, DELETEs) is
//! written and its answer read by ebb itself (`h1hop/raw.rs`), on the HTTP/1.1 fast path's
//! connections and pool ([`super::h1`]'s `backend_conn`): its head is written from the request's
//! parts in one write, the answer's head parsed with `httparse`
//! ([`ebb_http::h1::parse_response_head`]: its framing, its connection's fate; interim 1xx
//! answers skipped), and its body read as the answer's body is polled, decoded from chunked
//! (trailers and all) or counted by `Content-Length`, its connection going back to the pool once
//! read to its end. No task and no channel stand between the request and its connection. A
//! pooled connection that the replica had closed (the write fails, or it ends before a byte of
//! the answer) is left for a fresh one, once.
//!
//! Other requests (with a body, which streams while the answer may begin, or asking for an
//! upgrade) go on hyper's connection API with a pool of ebb's own per proxy thread:
//!
//! A request takes an idle keep-alive connection to its replica, or opens one within the
//! replica's bound on openings ([`backends`]), or waits for whichever comes first: a connection
//! coming back idle, or an opening ending. It never starts a connection it will not use. (hyper's
//! pooled client raced every miss against a connect of its own and left the loser to finish in
//! the background: under a load with more requests under way than connections, those connects
//! queued up behind the bound on openings without end, about 2 KiB each, thousands a second.)
//!
//! * A connection goes back to the pool when its answer's body has been read to its end (and
//!   its answer was not an upgrade); one whose body was dropped earlier is closed.
//! * At most `pool_max_idle_per_host` idle connections are kept per replica and thread; one idle
//!   for `pool_idle_timeout_ms` is closed when next met, and the addresses kept are swept of
//!   emptied lists whenever a new one is added.
//! * A pooled connection found closed is dropped and the next taken; a request that a pooled
//!   connection could not send at all (it was closing) is sent once more on another.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::Notify;

use super::backends::{self, Backends, Dial, Settling};
use super::{Body, BoxError, SendError as Error};
use crate::clock::Clock;

/// One replica's idle connections on this thread, newest last.
#[derive(Default)]
struct Idle {
    conns: Vec<(SendRequest<Body>, u64)>,
    /// A connection came back.
    returned: Arc<Notify>,
}

thread_local! {
    static POOL: RefCell<HashMap<SocketAddr, Idle>> = RefCell::new(HashMap::new());
}

/// The newest idle connection to `addr` not idle past the bound.
fn take_idle(addr: SocketAddr, dial: Dial<'_>) -> Option<SendRequest<Body>> {
    let now = dial.clock.now_ms();
    POOL.with(|p| {
        let mut pool = p.borrow_mut();
        let idle = pool.get_mut(&addr)?;
        while let Some((sender, since)) = idle.conns.pop() {
            let stale =
                dial.idle_timeout_ms > 0 && now.saturating_sub(since) >= dial.idle_timeout_ms;
            if !stale && !sender.is_closed() {
                return Some(sender);
            }
        }
        None
    })
}

/// `addr`'s idle connections on this thread; a new address first sweeps away the emptied lists.
fn idle_of(pool: &mut HashMap<SocketAddr, Idle>, addr: SocketAddr) -> &mut Idle {
    if !pool.contains_key(&addr) {
        pool.retain(|_, idle| !idle.conns.is_empty());
    }
    pool.entry(addr).or_default()
}

/// Puts a connection whose answer ended back among `addr`'s idle ones.
fn give_back(addr: SocketAddr, sender: SendRequest<Body>, max_idle: usize, now_ms: u64) {
    if sender.is_closed() || max_idle == 0 {
        return;
    }
    POOL.with(|p| {
        let mut pool = p.borrow_mut();
        let idle = idle_of(&mut pool, addr);
        if idle.conns.len() >= max_idle {
            idle.conns.remove(0);
        }
        idle.conns.push((sender, now_ms));
        idle.returned.notify_one();
    });
}

/// A connection for a request to `addr`: an idle one, a new one (with its opening, to end at
/// the first answer), or the first of those to be had ([`backends::get_connection`], as the
/// HTTP/1.1 fast path's in `h1.rs`). An address no ready list names is not paced: a connection
/// is opened for it when none is idle.
async fn checkout(
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
) -> Result<(SendRequest<Body>, Option<Settling>), Error> {
    // The common case first: an idle connection, ready. The wait and the opening are a future
    // of their own, boxed, so that every request's state does not carry theirs.
    if let Some(mut sender) = take_idle(addr, dial)
        && sender.ready().await.is_ok()
    {
        return Ok((sender, None));
    }
    Box::pin(wait_or_open(addr, dial, backends)).await
}

/// [`checkout`] when no idle connection was at hand.
async fn wait_or_open(
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
) -> Result<(SendRequest<Body>, Option<Settling>), Error> {
    let replica = backends.find(addr);
    let returned = POOL.with(|p| idle_of(&mut p.borrow_mut(), addr).returned.clone());
    let (stream, opening) = loop {
        let got = match &replica {
            Some(r) => {
                let take = || take_idle(addr, dial);
                backends::get_connection(r, &returned, take, dial.attempt_ms, dial.timeout_ms).await
            }
            None => match take_idle(addr, dial) {
                Some(idle) => Ok(backends::Got::Idle(idle)),
                None => {
                    let stream = backends::connect(addr, dial.attempt_ms, dial.timeout_ms, None)
                        .await
                        .map_err(Error::connect)?;
                    break (stream, None);
                }
            },
        };
        match got.map_err(Error::connect)? {
            // One that closed meanwhile is dropped, and the next looked for.
            backends::Got::Idle(mut sender) => {
                if sender.ready().await.is_ok() {
                    return Ok((sender, None));
                }
            }
            backends::Got::New(stream, opening) => break (stream, Some(opening)),
        }
    };
    let settling = opening.map(backends::Opening::settling);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(%addr, error = %e, "connection to a replica ended");
        }
    });
    Ok((sender, settling))
}

/// Whether [`send`] gives `req`'s head back when the replica goes away before answering (or
/// cannot be reached): a request ebb exchanges itself (`raw`), which has no body. The caller
/// keeps no copy of such a head for another try.
pub fn gives_head_back(req: &Request<Body>) -> bool {
    raw::takes(req)
}

/// Sends `req` (its URI the path; its `Host` set) over HTTP/1.1 to `addr` and waits for the
/// answer's head.
pub async fn send(
    mut req: Request<Body>,
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
) -> Result<Response<Body>, Error> {
    *req.version_mut() = hyper::Version::HTTP_11;
    // The origin form: the connection is the replica's already.
    if let Some(pq) = req.uri().path_and_query().cloned() {
        *req.uri_mut() = hyper::Uri::from(pq);
    }
    if raw::takes(&req) {
        return raw::send(req, addr, dial, backends).await;
    }
    let mut again = true;
    loop {
        let (mut sender, settling) = match checkout(addr, dial, backends).await {
            Ok(c) => c,
            // Not connected: the request goes back whole, for another try.
            Err(e) => return Err(e.unsent(req)),
        };
        let pooled = settling.is_none();
        let answer = match sender.try_send_request(req).await {
            Ok(a) => a,
            Err(mut e) => match e.take_message() {
                // Never sent: the pooled connection was closing. Once more, on another.
                Some(r) if pooled && again => {
                    again = false;
                    req = r;
                    continue;
                }
                _ => return Err(e.into_error().into()),
            },
        };
        if let Some(s) = &settling {
            s.answered();
        }
        let upgraded = answer.status() == StatusCode::SWITCHING_PROTOCOLS;
        let max_idle = if upgraded { 0 } else { dial.max_idle };
        let clock = dial.clock.clone();
        return Ok(answer.map(|body| {
            Back {
                body,
                sender: Some(sender),
                addr,
                max_idle,
                clock,
            }
            .boxed()
        }));
    }
}

/// An answer's body that gives its connection back to the pool once read to its end.
struct Back {
    body: Incoming,
    sender: Option<SendRequest<Body>>,
    addr: SocketAddr,
    max_idle: usize,
    clock: Arc<dyn Clock>,
}

impl Back {
    fn ended(&mut self) {
        if let Some(sender) = self.sender.take() {
            give_back(self.addr, sender, self.max_idle, self.clock.now_ms());
        }
    }
}

impl hyper::body::Body for Back {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        match &frame {
            None => self.ended(),
            Some(Ok(_)) if self.body.is_end_stream() => self.ended(),
            Some(Err(_)) => {
                self.sender.take();
            }
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame.map(|f| f.map_err(BoxError::from)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Back {
    fn drop(&mut self) {
        // Read to its end already (an empty body is never polled): the connection may be used
        // again; otherwise it is closed with its sender.
        if self.body.is_end_stream() {
            self.ended();
        }
    }
}

mod raw;

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{Empty, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::clock::SystemClock;

    /// The requests' heads a [`replica`] read, in order.
    type Heads = Arc<std::sync::Mutex<Vec<String>>>;

    /// An HTTP/1.1 replica on loopback answering the n-th request head it reads (of any
    /// connection) with `answer(n)`: the bytes, and whether it closes that connection after them;
    /// with a `gate`, each answer waits for a permit. It keeps the request heads it read and
    /// counts the connections it accepted.
    async fn replica(
        answer: impl Fn(usize) -> (&'static [u8], bool) + Send + Sync + 'static,
        gate: Option<Arc<tokio::sync::Semaphore>>,
    ) -> (SocketAddr, Arc<AtomicUsize>, Heads) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let heads: Heads = Default::default();
        let answer = Arc::new(answer);
        let (counted, kept) = (accepted.clone(), heads.clone());
        tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::SeqCst);
                let (answer, kept, gate) = (answer.clone(), kept.clone(), gate.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head: Vec<u8> = buf.drain(..end + 4).collect();
                            let n = {
                                let mut k = kept.lock().unwrap();
                                k.push(String::from_utf8_lossy(&head).into_owned());
                                k.len() - 1
                            };
                            if let Some(g) = &gate {
                                g.acquire().await.unwrap().forget();
                            }
                            let (bytes, close) = answer(n);
                            if tcp.write_all(bytes).await.is_err() {
                                return;
                            }
                            if close {
                                let _ = tcp.shutdown().await;
                                return;
                            }
                        }
                        match tcp.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        (addr, accepted, heads)
    }

    /// A [`replica`] answering the n-th request with `answers[n]`, closing after it if `closes[n]`.
    async fn scripted(
        answers: Vec<&'static [u8]>,
        closes: Vec<bool>,
    ) -> (SocketAddr, Arc<AtomicUsize>, Heads) {
        replica(move |n| (answers[n], closes[n]), None).await
    }

    fn get(addr: SocketAddr) -> Request<Body> {
        Request::get(format!("http://{addr}/x"))
            .header(hyper::header::HOST, "app.localhost")
            .body(Empty::new().map_err(|e| match e {}).boxed())
            .unwrap()
    }

    async fn text(r: Result<Response<Body>, Error>) -> String {
        let body = r.unwrap().into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn requests_reuse_idle_connections_and_open_none_they_do_not_use() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        // Every request answered `ok` on keep-alive connections once the gate lets it.
        let ok: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        let (addr, accepted, _) = replica(move |_| (ok, false), Some(gate.clone())).await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 60_000);
        let backends = Backends::default();
        // A paced replica: one opening at a time, each held until its connection answers.
        let _replica = backends.replica(addr, 1, 1);
        // Forty requests at once, the server answering one at a time: the first connection's
        // answer widens the window, but every request waits for an idle connection or an
        // opening, so no connection is opened beyond those the requests take.
        let calls: Vec<_> = (0..40)
            .map(|_| Box::pin(send(get(addr), addr, dial, &backends)))
            .collect();
        let all = futures_util::future::join_all(
            calls.into_iter().map(|c| async { text(c.await).await }),
        );
        let release = async {
            for _ in 0..40 {
                gate.add_permits(1);
                tokio::task::yield_now().await;
            }
        };
        let (answers, ()) = tokio::join!(all, release);
        assert!(answers.iter().all(|a| a == "ok"), "{answers:?}");
        let opened = accepted.load(Ordering::SeqCst);
        assert!((1..=40).contains(&opened), "{opened} connections");
        // Nothing is still being opened in the background: the next requests, one at a time,
        // reuse the idle connections and open none.
        gate.add_permits(10);
        for _ in 0..10 {
            assert_eq!(
                text(send(get(addr), addr, dial, &backends).await).await,
                "ok"
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), opened);
        // A body is sent too.
        gate.add_permits(1);
        assert_eq!(
            text(send(post(addr), addr, dial, &backends).await).await,
            "ok"
        );
        // Requests with a body go on hyper's connections, which are pooled apart: the first
        // opens one, the next reuses it.
        assert_eq!(accepted.load(Ordering::SeqCst), opened + 1);
        gate.add_permits(1);
        assert_eq!(
            text(send(post(addr), addr, dial, &backends).await).await,
            "ok"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), opened + 1);
    }

    fn post(addr: SocketAddr) -> Request<Body> {
        Request::post(format!("http://{addr}/x"))
            .header(hyper::header::HOST, "app.localhost")
            .body(
                Full::new(Bytes::from_static(b"hi"))
                    .map_err(|e| match e {})
                    .boxed(),
            )
            .unwrap()
    }

    fn request(method: &str, addr: SocketAddr, path: &str) -> Request<Body> {
        Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"))
            .header(hyper::header::HOST, "app.localhost")
            .header("x-in", "1")
            .body(Empty::new().map_err(|e| match e {}).boxed())
            .unwrap()
    }

    #[tokio::test]
    async fn bodyless_requests_are_exchanged_here_on_kept_connections() {
        let (addr, accepted, heads) = scripted(
            vec![
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
                  HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: 1\r\nx-a: 2\r\n\r\nhello",
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                  3;x=y\r\nabc\r\n2\r\nde\r\n0\r\ngrpc-status: 0\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n",
                b"HTTP/1.1 204 No Content\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n",
            ],
            vec![false; 5],
        )
        .await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 60_000);
        let backends = Backends::default();
        let got = send(request("GET", addr, "/x?q=1"), addr, dial, &backends)
            .await
            .unwrap();
        assert_eq!(got.status(), StatusCode::OK);
        let a: Vec<_> = got.headers().get_all("x-a").iter().collect();
        assert_eq!(
            a,
            ["1", "2"],
            "the final answer's headers, not the interim ones'"
        );
        assert!(!got.headers().contains_key("link"));
        assert_eq!(got.into_body().collect().await.unwrap().to_bytes(), "hello");
        // A chunked answer, decoded, with its trailers.
        let got = send(request("GET", addr, "/"), addr, dial, &backends)
            .await
            .unwrap();
        let body = got.into_body().collect().await.unwrap();
        assert_eq!(body.trailers().unwrap()["grpc-status"], "0");
        assert_eq!(body.to_bytes(), "abcde");
        // HEAD's answer has no body whatever its length says; nor has a 204.
        let got = send(request("HEAD", addr, "/"), addr, dial, &backends)
            .await
            .unwrap();
        assert_eq!(got.headers()["content-length"], "99");
        assert_eq!(text(Ok(got)).await, "");
        let got = send(request("DELETE", addr, "/"), addr, dial, &backends)
            .await
            .unwrap();
        assert_eq!(got.status(), StatusCode::NO_CONTENT);
        assert_eq!(text(Ok(got)).await, "");
        // A chunked answer without trailers has none.
        let got = send(request("GET", addr, "/"), addr, dial, &backends)
            .await
            .unwrap();
        let body = got.into_body().collect().await.unwrap();
        assert!(body.trailers().is_none());
        assert_eq!(body.to_bytes(), "ab");
        // One connection carried them all.
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        let heads = heads.lock().unwrap().clone();
        assert_eq!(
            heads[0],
            "GET /x?q=1 HTTP/1.1\r\nhost: app.localhost\r\nx-in: 1\r\n\r\n"
        );
        assert!(heads[2].starts_with("HEAD / HTTP/1.1\r\n"), "{}", heads[2]);
    }

    #[tokio::test]
    async fn only_a_connection_whose_answer_was_read_to_its_end_in_keep_alive_is_kept() {
        let (addr, accepted, _) = scripted(
            vec![
                // Read to the replica's close.
                b"HTTP/1.1 200 OK\r\n\r\nuntil close",
                // Dropped before its end.
                b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabcd",
                // The replica asks to close.
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            ],
            vec![true, false, false, false],
        )
        .await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 60_000);
        let backends = Backends::default();
        let got = send(request("GET", addr, "/"), addr, dial, &backends).await;
        assert_eq!(text(got).await, "until close");
        let got = send(request("GET", addr, "/"), addr, dial, &backends)
            .await
            .unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        drop(got);
        assert_eq!(
            text(send(request("GET", addr, "/"), addr, dial, &backends).await).await,
            "ok"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert_eq!(
            text(send(request("GET", addr, "/"), addr, dial, &backends).await).await,
            "ok"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_kept_connection_the_replica_closed_is_left_for_a_fresh_one() {
        // The replica closes each connection after its answer, without saying so.
        let ok: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        let (addr, accepted, heads) = scripted(vec![ok, ok], vec![true, true]).await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 60_000);
        let backends = Backends::default();
        for _ in 0..2 {
            assert_eq!(
                text(send(request("GET", addr, "/"), addr, dial, &backends).await).await,
                "ok"
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(
            heads.lock().unwrap().len(),
            2,
            "each request was processed once"
        );
    }

    #[tokio::test]
    async fn a_malformed_answer_is_an_error_that_is_not_a_went_away() {
        let (addr, _, _) = scripted(
            vec![
                b"HTTP/1.1 2000 OK\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nok",
            ],
            vec![true, true, true],
        )
        .await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 60_000);
        let backends = Backends::default();
        let e = send(request("GET", addr, "/"), addr, dial, &backends)
            .await
            .unwrap_err();
        assert!(!crate::backend_went_away(&e), "{e}");
        let got = send(request("GET", addr, "/"), addr, dial, &backends)
            .await
            .unwrap();
        let e = got.into_body().collect().await.unwrap_err();
        assert!(e.to_string().contains("chunk"), "{e}");
        let e = send(request("GET", addr, "/"), addr, dial, &backends)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("Content-Length"), "{e}");
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_a_closed_one_went_away() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 0);
        let mut e = send(get(addr), addr, dial, &Backends::default())
            .await
            .unwrap_err();
        assert!(e.is_connect(), "{e}");
        // None of it left ebb: the request comes back whole, for another try.
        let whole = e.take_unsent().expect("the request given back");
        assert_eq!(
            (whole.method(), whole.uri().path()),
            (&hyper::Method::GET, "/x")
        );
        // A replica that closes the connection without answering.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = tcp.read(&mut buf).await;
            }
        });
        let mut e = send(get(addr), addr, dial, &Backends::default())
            .await
            .unwrap_err();
        assert!(crate::backend_went_away(&e), "{e}");
        // The request had no body: its head comes back (the caller kept no copy), once.
        assert!(gives_head_back(&get(addr)));
        let head = e.take_head().expect("the head given back");
        assert_eq!((head.method, head.uri.path()), (hyper::Method::GET, "/x"));
        assert_eq!(head.headers[hyper::header::HOST], "app.localhost");
        assert!(e.take_head().is_none());
    }
}
