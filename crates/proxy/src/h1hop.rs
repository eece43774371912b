//! The general path's HTTP/1.1 hop to replicas (the requests of HTTP/2 clients and of HTTP/1.0
//! ones, upgrades), on hyper's connection API with a pool of ebb's own per proxy thread.
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
                        .map_err(Error::Connect)?;
                    break (stream, None);
                }
            },
        };
        match got.map_err(Error::Connect)? {
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
    let mut again = true;
    loop {
        let (mut sender, settling) = checkout(addr, dial, backends).await?;
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{Empty, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::clock::SystemClock;

    /// An HTTP/1.1 server on loopback answering every request `ok` on keep-alive connections once
    /// `gate` lets it, counting the connections it accepted.
    async fn server(gate: Arc<tokio::sync::Semaphore>) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::SeqCst);
                let gate = gate.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            gate.acquire().await.unwrap().forget();
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if tcp.write_all(answer).await.is_err() {
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
        (addr, accepted)
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
        let (addr, accepted) = server(gate.clone()).await;
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
        // A body that arrived whole is sent, and its connection kept.
        gate.add_permits(1);
        let post = Request::post(format!("http://{addr}/x"))
            .header(hyper::header::HOST, "app.localhost")
            .body(
                Full::new(Bytes::from_static(b"hi"))
                    .map_err(|e| match e {})
                    .boxed(),
            )
            .unwrap();
        assert_eq!(text(send(post, addr, dial, &backends).await).await, "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), opened);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_a_closed_one_went_away() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 0);
        let e = send(get(addr), addr, dial, &Backends::default())
            .await
            .unwrap_err();
        assert!(e.is_connect(), "{e}");
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
        let e = send(get(addr), addr, dial, &Backends::default())
            .await
            .unwrap_err();
        assert!(crate::backend_went_away(&e), "{e}");
    }
}
