//! The HTTP/2 hop to replicas that speak h2c (gRPC servers, h2c destinations of meta services),
//! driven with the `h2` crate directly.
//!
//! Each proxy thread keeps multiplexed connections to each replica address (one, and more while
//! the replica's stream limit fills those open). A request opens a stream on one from the task
//! that serves the client's request: no channel to a connection task, no task per request, no
//! pool checkout (hyper's client does all three for each HTTP/2 request, and they were a fifth of
//! ebb's CPU on gRPC). Each connection is driven by a task of its own on the thread that opened
//! it.
//!
//! * A request body that has fully arrived when its stream opens (a unary gRPC call's one message)
//!   is sent at once; one still arriving is sent by a task that follows the stream's flow
//!   control, and resets the stream when the request is abandoned before its answer began.
//! * The answer's body is the stream's: its data, released to the replica's flow control as it
//!   is passed on, then its trailers.
//! * A request takes the first of the thread's connections to its address with room for a stream
//!   under the replica's `SETTINGS_MAX_CONCURRENT_STREAMS` ([`ASSUMED_STREAMS`] until its
//!   settings arrive); when none has, another connection is opened, up to [`MAX_CONNS`] an
//!   address. Past that the least busy one is shared, and its streams wait in `h2` for room (the
//!   route's timeouts bound the wait). With one connection a thread, a replica's limit was ebb's:
//!   the example app allows 200 streams (hyper's default), and of 640 concurrent gRPC calls on
//!   two threads, 240 waited in ebb while HAProxy opened more connections; ebb served 0.85-0.86x
//!   HAProxy's calls, and 0.96-1.04x with connections added as needed.
//! * A connection that ended (the replica closed it, or it failed) is replaced by the next
//!   request; the addresses kept are swept of ended connections whenever a new one opens, so
//!   the map holds the live connections and those being opened. A connection with no stream
//!   open and no request for the proxy's `pool_idle_timeout_ms` is closed, as the HTTP/1.1
//!   pools' idle connections are (calls fill the first with room, so the last ones go idle
//!   first).
//! * `/metrics` counts the connections open and opened ([`connections`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use h2::client::SendRequest;
use h2::{Reason, RecvStream, SendStream};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame, SizeHint};
use hyper::header::{self, HeaderMap};
use hyper::{Request, Response};
use tokio::sync::{OnceCell, oneshot};

use super::backends::{self, Backends, Dial};
use super::{Body, BoxError, SendError as Error};

/// The h2 client's settings, as hyper's client sets them: 2 MiB a stream and 5 MiB a
/// connection of receive window, at most 1 MiB buffered to send per stream.
const STREAM_WINDOW: u32 = 2 << 20;
const CONN_WINDOW: u32 = 5 << 20;
const MAX_SEND_BUFFER: usize = 1 << 20;
/// A request body's frame sent without waiting for flow control (it fits any initial window).
const EAGER_MAX: usize = 16 * 1024;
/// The most connections a proxy thread keeps to one address.
pub const MAX_CONNS: usize = 16;
/// The streams a replica is taken to allow at once until its settings say (RFC 9113 asks a
/// server to allow at least 100; Go's HTTP/2 client assumes as much). `h2` takes no limit until
/// then, so a burst sent before the settings arrived went past a replica's limit, and the replica
/// refused the excess; now only a limit under 100 can be passed so.
const ASSUMED_STREAMS: usize = 100;

/// The hop's connections to replicas open now, on every proxy thread (`/metrics`).
static OPEN: AtomicUsize = AtomicUsize::new(0);
/// The hop's connections to replicas opened since the start.
static OPENED: AtomicU64 = AtomicU64::new(0);

/// The hop's connections to replicas: open now, and opened since the start.
pub fn connections() -> (usize, u64) {
    (OPEN.load(Ordering::Relaxed), OPENED.load(Ordering::Relaxed))
}

/// A connection counted open until its task ends (or is dropped).
struct Open;

impl Open {
    fn new() -> Self {
        OPEN.fetch_add(1, Ordering::Relaxed);
        OPENED.fetch_add(1, Ordering::Relaxed);
        Open
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection to one address: opened once by whichever request takes it first.
struct Conn {
    sender: OnceCell<SendRequest<Bytes>>,
    /// Set by the connection's task when it ends.
    ended: AtomicBool,
    /// When a request last took the connection, by the proxy's clock.
    used_at_ms: AtomicU64,
    /// Requests on it whose answer has not ended (or been dropped).
    under_way: AtomicUsize,
}

impl Conn {
    fn new() -> Self {
        Conn {
            sender: OnceCell::new(),
            ended: AtomicBool::new(false),
            used_at_ms: AtomicU64::new(0),
            under_way: AtomicUsize::new(0),
        }
    }

    /// Whether another request may take it: it has not ended, and the replica allows another
    /// stream (until its settings are known, [`ASSUMED_STREAMS`]).
    fn has_room(&self) -> bool {
        !self.ended.load(Ordering::Acquire)
            && self.under_way.load(Ordering::Relaxed)
                < self
                    .sender
                    .get()
                    .map_or(ASSUMED_STREAMS, |s| s.current_max_send_streams())
    }
}

/// A request under way on a connection: counted from when it takes the connection until its
/// answer's body is dropped.
struct UnderWay(Arc<Conn>);

impl UnderWay {
    fn new(conn: Arc<Conn>) -> Self {
        conn.under_way.fetch_add(1, Ordering::Relaxed);
        UnderWay(conn)
    }
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        self.0.under_way.fetch_sub(1, Ordering::Relaxed);
    }
}

thread_local! {
    static CONNS: RefCell<HashMap<SocketAddr, Vec<Arc<Conn>>>> = RefCell::new(HashMap::new());
}

/// The thread's connection to `addr` for a request, the request counted on it: the first with
/// room, else a new (unopened) one, else (the address has [`MAX_CONNS`]) the least busy. Ended
/// connections are swept from the address's list then, and from every address's when one opens.
fn conn_for(addr: SocketAddr) -> UnderWay {
    CONNS.with(|c| {
        let mut conns = c.borrow_mut();
        let list = conns.entry(addr).or_default();
        if let Some(conn) = list.iter().find(|c| c.has_room()) {
            return UnderWay::new(conn.clone());
        }
        list.retain(|c| !c.ended.load(Ordering::Acquire));
        if list.len() >= MAX_CONNS {
            let least = list
                .iter()
                .min_by_key(|c| c.under_way.load(Ordering::Relaxed))
                .expect("at the bound: not empty");
            return UnderWay::new(least.clone());
        }
        let conn = Arc::new(Conn::new());
        list.push(conn.clone());
        conns.retain(|_, list| {
            list.retain(|c| !c.ended.load(Ordering::Acquire));
            !list.is_empty()
        });
        UnderWay::new(conn)
    })
}

/// Marks `conn` ended (it failed): the next request to its address replaces it ([`conn_for`]).
fn forget(conn: &Conn) {
    conn.ended.store(true, Ordering::Release);
}

/// Opens a connection to `addr` and starts its task.
async fn open(
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
    conn: &Arc<Conn>,
) -> Result<SendRequest<Bytes>, Error> {
    let replica = backends.find(addr);
    let stream = backends::connect(addr, dial.attempt_ms, dial.timeout_ms, replica.as_deref())
        .await
        .map_err(Error::connect)?;
    let (sender, connection) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .initial_max_send_streams(ASSUMED_STREAMS)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .max_header_list_size(dial.max_header_list_size)
        .enable_push(false)
        .handshake::<_, Bytes>(stream)
        .await?;
    let watched = conn.clone();
    let (idle_ms, clock) = (dial.idle_timeout_ms, dial.clock.clone());
    let open = Open::new();
    tokio::spawn(async move {
        let _open = open;
        tokio::pin!(connection);
        let mut wait = Duration::from_millis(idle_ms.max(1));
        loop {
            tokio::select! {
                r = &mut connection => {
                    if let Err(e) = r {
                        tracing::debug!(%addr, error = %e, "h2c connection to a replica ended");
                    }
                    break;
                }
                () = tokio::time::sleep(wait), if idle_ms > 0 => {
                    let used = watched.used_at_ms.load(Ordering::Relaxed);
                    let idle_for = clock.now_ms().saturating_sub(used);
                    if idle_for >= idle_ms && watched.under_way.load(Ordering::Relaxed) == 0 {
                        tracing::debug!(%addr, "closing an idle h2c connection to a replica");
                        break;
                    }
                    wait = Duration::from_millis(idle_ms.saturating_sub(idle_for).max(1));
                }
            }
        }
        watched.ended.store(true, Ordering::Release);
    });
    Ok(sender)
}

/// A stream on the thread's connection to `addr`, ready for a request: the connection is opened
/// when there is none, and once more when the one found had ended.
async fn ready_sender(
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
) -> Result<(SendRequest<Bytes>, UnderWay), Error> {
    let mut tried_fresh = false;
    loop {
        let under_way = conn_for(addr);
        let conn = &under_way.0;
        let fresh = !conn.sender.initialized();
        conn.used_at_ms
            .store(dial.clock.now_ms(), Ordering::Relaxed);
        let sender = match conn
            .sender
            // Boxed: the opening's state is not every request's.
            .get_or_try_init(|| Box::pin(open(addr, dial, backends, conn)))
            .await
        {
            Ok(s) => s.clone(),
            Err(e) => {
                forget(conn);
                return Err(e);
            }
        };
        match sender.ready().await {
            Ok(s) => return Ok((s, under_way)),
            Err(e) => {
                forget(conn);
                if fresh || tried_fresh {
                    return Err(e.into());
                }
                tried_fresh = true;
            }
        }
    }
}

/// Sends `req` (its URI the replica's address and the path) over h2c and waits for the
/// answer's head.
pub async fn send(
    req: Request<Body>,
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
) -> Result<Response<Body>, Error> {
    let (mut sender, under_way) = match ready_sender(addr, dial, backends).await {
        Ok(s) => s,
        // Not connected: the request goes back whole, for another try.
        Err(e) => return Err(e.unsent(req)),
    };
    let (mut parts, body) = req.into_parts();
    strip_connection_headers(&mut parts.headers);
    let end = body.is_end_stream();
    let (answer, stream) = sender.send_request(Request::from_parts(parts, ()), end)?;
    let mut cancel = None;
    if !end {
        let (tx, rx) = oneshot::channel();
        let mut pipe = Box::pin(pipe(body, stream, rx));
        // A body already here (a unary call's message) goes out now, without a task.
        let done = std::future::poll_fn(|cx| Poll::Ready(pipe.as_mut().poll(cx).is_ready())).await;
        if !done {
            tokio::spawn(pipe);
            cancel = Some(Cancel(Some(tx)));
        }
    }
    let answer = answer.await?;
    if let Some(mut c) = cancel {
        c.disarm();
    }
    Ok(answer.map(|recv| {
        Stream {
            recv,
            data_done: false,
            _under_way: under_way,
        }
        .boxed()
    }))
}

/// Resets the stream of a request abandoned before its answer began (the pipe still sending its
/// body holds the stream open otherwise).
struct Cancel(Option<oneshot::Sender<()>>);

impl Cancel {
    fn disarm(&mut self) {
        self.0.take();
    }
}

impl Drop for Cancel {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// Headers HTTP/2 forbids (RFC 9113 section 8.2.2); `h2` refuses a request carrying any.
fn strip_connection_headers(headers: &mut HeaderMap) {
    for n in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(n);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
    if headers
        .get(header::TE)
        .is_some_and(|te| te.as_bytes() != b"trailers")
    {
        headers.remove(header::TE);
    }
}

/// Sends a request body on its stream, within the stream's flow control: its data, then its
/// trailers or the end. A body that fails, or a cancel, resets the stream; a stream the replica
/// reset ends it.
async fn pipe(mut body: Body, mut tx: SendStream<Bytes>, mut cancel: oneshot::Receiver<()>) {
    let mut watching = true;
    loop {
        let frame = tokio::select! {
            biased;
            f = body.frame() => f,
            r = &mut cancel, if watching => {
                if r.is_ok() {
                    tx.send_reset(Reason::CANCEL);
                    return;
                }
                watching = false;
                continue;
            }
            _ = std::future::poll_fn(|cx| tx.poll_reset(cx)) => return,
        };
        let frame = match frame {
            None => {
                let _ = tx.send_data(Bytes::new(), true);
                return;
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "a request body failed; resetting its h2c stream");
                tx.send_reset(Reason::CANCEL);
                return;
            }
            Some(Ok(f)) => f,
        };
        let frame = match frame.into_data() {
            Ok(mut data) => {
                let end = body.is_end_stream();
                if end && data.len() <= EAGER_MAX {
                    let _ = tx.send_data(data, true);
                    return;
                }
                while data.has_remaining() {
                    tx.reserve_capacity(data.len());
                    let room = match std::future::poll_fn(|cx| tx.poll_capacity(cx)).await {
                        Some(Ok(n)) => n,
                        _ => return,
                    };
                    if room == 0 {
                        continue;
                    }
                    let chunk = data.split_to(room.min(data.len()));
                    if tx.send_data(chunk, end && data.is_empty()).is_err() {
                        return;
                    }
                }
                if end {
                    return;
                }
                continue;
            }
            Err(f) => f,
        };
        if let Ok(trailers) = frame.into_trailers() {
            let _ = tx.send_trailers(trailers);
            return;
        }
    }
}

/// An answer's body: the stream's data, each frame's room given back to the replica as it is
/// passed on, then its trailers.
struct Stream {
    recv: RecvStream,
    data_done: bool,
    _under_way: UnderWay,
}

impl hyper::body::Body for Stream {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if !self.data_done {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => self.data_done = true,
            }
        }
        match ready!(self.recv.poll_trailers(cx)) {
            Ok(Some(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e.into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use http_body_util::{Full, StreamBody};
    use tokio::net::TcpListener;

    use super::*;
    use crate::clock::{Clock, SystemClock};

    /// An h2c server on loopback answering `ok` with a `grpc-status` trailer, counting the
    /// connections it accepted and those that ended.
    async fn server() -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, ended) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (a, e) = (accepted.clone(), ended.clone());
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let e = e.clone();
                tokio::spawn(async move {
                    let mut conn = h2::server::handshake(tcp).await.unwrap();
                    while let Some(Ok((req, mut respond))) = conn.accept().await {
                        tokio::spawn(async move {
                            let mut body = req.into_body();
                            let mut got = 0;
                            while let Some(Ok(d)) = body.data().await {
                                got += d.len();
                                let _ = body.flow_control().release_capacity(d.len());
                            }
                            let mut tx = respond.send_response(Response::new(()), false).unwrap();
                            tx.send_data(Bytes::from(format!("ok {got}")), false)
                                .unwrap();
                            let mut trailers = HeaderMap::new();
                            trailers.insert("grpc-status", "0".parse().unwrap());
                            tx.send_trailers(trailers).unwrap();
                        });
                    }
                    e.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        (addr, accepted, ended)
    }

    fn request(addr: SocketAddr, body: Body) -> Request<Body> {
        Request::post(format!("http://{addr}/echo"))
            .header(header::CONNECTION, "keep-alive")
            .header(header::TE, "trailers")
            .body(body)
            .unwrap()
    }

    async fn answer(r: Result<Response<Body>, Error>) -> (String, Option<HeaderMap>) {
        let collected = r.unwrap().into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        (
            String::from_utf8(collected.to_bytes().to_vec()).unwrap(),
            trailers,
        )
    }

    /// Polls `holds` for at most 10 s.
    async fn until(what: &str, holds: impl Fn() -> bool) {
        for _ in 0..1_000 {
            if holds() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{what}: not within 10 s");
    }

    #[tokio::test]
    async fn calls_share_one_connection_bodies_stream_and_an_idle_one_closes() {
        let (addr, accepted, ended) = server().await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 300);
        let backends = Backends::default();
        // A body already here, none at all, and one still arriving (sent by the pipe's task).
        let whole = Full::new(Bytes::from_static(b"hello"))
            .map_err(|e| match e {})
            .boxed();
        let (more, mut rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let later =
            StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))).boxed();
        let empty = http_body_util::Empty::new().map_err(|e| match e {}).boxed();
        let (a, b) = (
            send(request(addr, whole), addr, dial, &backends),
            send(request(addr, empty), addr, dial, &backends),
        );
        let (a, b) = tokio::join!(a, b);
        let (text, trailers) = answer(a).await;
        assert_eq!(text, "ok 5");
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
        assert_eq!(answer(b).await.0, "ok 0");
        let streaming =
            async { answer(send(request(addr, later), addr, dial, &backends).await).await };
        let feed = async move {
            for chunk in [&b"abc"[..], &b"defg"[..]] {
                more.send(Ok(Frame::data(Bytes::from_static(chunk))))
                    .await
                    .unwrap();
            }
        };
        let ((text, _), ()) = tokio::join!(streaming, feed);
        assert_eq!(text, "ok 7");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the calls shared one connection"
        );
        // Unused for the idle bound, with no stream open: closed; the next call opens another.
        until("the idle connections close", || {
            ended.load(Ordering::SeqCst) == accepted.load(Ordering::SeqCst)
        })
        .await;
        let before = accepted.load(Ordering::SeqCst);
        let again = http_body_util::Empty::new().map_err(|e| match e {}).boxed();
        assert_eq!(
            answer(send(request(addr, again), addr, dial, &backends).await)
                .await
                .0,
            "ok 0"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), before + 1);
    }

    /// An h2c server allowing `limit` streams a connection, whose answers wait for `release`;
    /// with the connections it accepted and the requests it holds.
    async fn held_server(
        limit: u32,
    ) -> (
        SocketAddr,
        Arc<AtomicUsize>,
        Arc<AtomicUsize>,
        tokio::sync::watch::Sender<bool>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, held) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (release, released) = tokio::sync::watch::channel(false);
        let (a, h) = (accepted.clone(), held.clone());
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let (h, released) = (h.clone(), released.clone());
                tokio::spawn(async move {
                    let mut conn = h2::server::Builder::new()
                        .max_concurrent_streams(limit)
                        .handshake(tcp)
                        .await
                        .unwrap();
                    while let Some(Ok((_, mut respond))) = conn.accept().await {
                        let (h, mut released) = (h.clone(), released.clone());
                        tokio::spawn(async move {
                            h.fetch_add(1, Ordering::SeqCst);
                            let _ = released.wait_for(|r| *r).await;
                            h.fetch_sub(1, Ordering::SeqCst);
                            let mut tx = respond.send_response(Response::new(()), false).unwrap();
                            tx.send_data(Bytes::from_static(b"ok"), true).unwrap();
                        });
                    }
                });
            }
        });
        (addr, accepted, held, release)
    }

    #[tokio::test]
    async fn a_replica_full_of_streams_gets_another_connection_up_to_the_bound() {
        let (addr, accepted, held, release) = held_server(1).await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 0);
        let backends = Backends::default();
        let empty = || http_body_util::Empty::new().map_err(|e| match e {}).boxed();
        // Whether `n` connections know the replica's limit of one stream.
        let known = |n: usize| {
            CONNS.with(|c| {
                c.borrow().get(&addr).is_some_and(|list| {
                    list.iter()
                        .filter(|c| {
                            c.sender
                                .get()
                                .is_some_and(|s| s.current_max_send_streams() == 1)
                        })
                        .count()
                        == n
                })
            })
        };
        // A first call, answered, tells the replica's limit of one stream a connection.
        release.send(true).unwrap();
        let first = send(request(addr, empty()), addr, dial, &backends).await;
        assert_eq!(answer(first).await.0, "ok");
        until("the replica's limit is known", || known(1)).await;
        release.send(false).unwrap();
        // Two calls more than the bound of connections, each sent once the one before is held
        // and every connection's limit is known: each of the first gets a connection of its
        // own, and the last two wait for room on one.
        let calls = (0..MAX_CONNS + 2).map(|i| {
            let (held, empty, known, backends) = (&held, &empty, &known, &backends);
            async move {
                let before = i.min(MAX_CONNS);
                until("the calls before held", || {
                    held.load(Ordering::SeqCst) == before && known(before.max(1))
                })
                .await;
                answer(send(request(addr, empty()), addr, dial, backends).await).await
            }
        });
        let answers = futures_util::future::join_all(calls);
        let under_way = || {
            CONNS.with(|c| {
                c.borrow().get(&addr).map_or(0, |list| {
                    list.iter()
                        .map(|c| c.under_way.load(Ordering::Relaxed))
                        .sum::<usize>()
                })
            })
        };
        let watch = async {
            until(
                "a connection for each call up to the bound, and two waiting",
                || held.load(Ordering::SeqCst) == MAX_CONNS && under_way() == MAX_CONNS + 2,
            )
            .await;
            assert_eq!(accepted.load(Ordering::SeqCst), MAX_CONNS);
            release.send(true).unwrap();
        };
        let (answers, ()) = tokio::join!(answers, watch);
        assert!(answers.iter().all(|(text, _)| text == "ok"), "{answers:?}");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            MAX_CONNS,
            "no more than the bound opened"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 0);
        let empty = http_body_util::Empty::new().map_err(|e| match e {}).boxed();
        let e = send(request(addr, empty), addr, dial, &Backends::default())
            .await
            .unwrap_err();
        assert!(e.is_connect(), "{e}");
        assert!(!crate::backend_went_away(&e));
    }
}
