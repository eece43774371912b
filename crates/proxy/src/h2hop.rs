//! The HTTP/2 hop to replicas that speak h2c (gRPC servers, h2c destinations of meta services),
//! on ebb's own client side ([`ebb_http::h2client`]).
//!
//! Each proxy thread keeps multiplexed connections to each replica address (one, and more while
//! the replica's stream limit fills those open). A connection is a task on the thread that
//! opened it: it reads the socket into the client side and writes what the requests' tasks hand
//! it, as the replica's windows let it. Between a request's task and its connection:
//!
//! * the request goes to the connection as one message ([`Cmd::Open`]) with what of its body
//!   had arrived already (a unary gRPC call's one message, up to [`EAGER_MAX`]); a body still
//!   arriving is sent on by a task of its own, each part taking credit from a budget per
//!   stream ([`BODY_BUDGET`]) that the connection returns as the part goes out, so what waits
//!   for the replica's windows is bounded;
//! * the answer comes back on a channel of its own: its head, its data (each part's window given
//!   back to the replica as it is passed on, so what waits in the channel is bounded by the
//!   windows this side gave), its trailers or its failure;
//! * a request abandoned (its client left, its body failed) resets its stream with CANCEL; an
//!   answer that ends before its request's body does ends the request too.
//!
//! A request takes the first of the thread's connections to its address with room for a stream
//! under the replica's `SETTINGS_MAX_CONCURRENT_STREAMS` ([`ASSUMED_STREAMS`] until its settings
//! arrive); when none has, another connection is opened, up to [`MAX_CONNS`] an address. Past
//! that the least busy one is shared, and its requests wait in the connection for a stream to
//! end (the route's timeouts bound the wait). With one connection a thread, a replica's limit
//! was ebb's: of 640 concurrent gRPC calls on two threads to a replica allowing 200 streams a
//! connection, 240 waited in ebb while HAProxy opened more connections.
//!
//! A connection that ended (the replica closed it, went away, or it failed) is replaced by the
//! next request; the addresses kept are swept of ended connections whenever a new one opens. A
//! connection with no stream open and no request for the proxy's `pool_idle_timeout_ms` says
//! GOAWAY and closes, as the HTTP/1.1 pools' idle connections are closed. A stream the replica
//! refused (REFUSED_STREAM, or past the last one of its GOAWAY) and a connection that ended
//! before the answer's head are [`Error::went_away`]: the request was not processed, and one
//! without a body is sent again to another replica. `/metrics` counts the connections open and
//! opened ([`connections`]).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use ebb_http::h2::ErrorCode;
use ebb_http::h2client::{Client, Config, Event};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame, SizeHint};
use hyper::header::HeaderMap;
use hyper::{Method, Request, Response, Uri};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OnceCell, Semaphore, mpsc, oneshot};

use super::backends::{self, Backends, Dial};
use super::h1::{Progress, Watchdog};
use super::h2parts::{self, Credit, Flushed, Waiting, header_map, release};
use super::{Body, BoxError, SendError};
use crate::clock::Clock;

/// This side's windows, as hyper's client sets them: 2 MiB a stream and 5 MiB a connection.
const STREAM_WINDOW: u32 = 2 << 20;
const CONN_WINDOW: u32 = 5 << 20;
/// Bytes of a request's body that may wait for the replica's windows beyond what came with
/// its head.
const BODY_BUDGET: usize = 256 * 1024;
/// Bytes of a request's body taken with its head when they have arrived already.
const EAGER_MAX: usize = 64 * 1024;
/// The most connections a proxy thread keeps to one address.
pub const MAX_CONNS: usize = 16;
/// The streams a replica is taken to allow at once until its settings say (RFC 9113 asks a
/// server to allow at least 100; Go's HTTP/2 client assumes as much).
const ASSUMED_STREAMS: usize = 100;
/// Messages from the requests' tasks taken before the connection writes what they made.
const CMD_BATCH: usize = 64;
/// Bytes read from the replica at once.
const READ_CHUNK: usize = 16 * 1024;

/// Why a request on the hop got no answer's head, or why its answer broke off.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The replica refused the stream (REFUSED_STREAM, or past its GOAWAY's last stream).
    #[error("the replica refused the stream")]
    Refused,
    #[error("the replica reset the stream ({})", .0.name())]
    Reset(ErrorCode),
    /// The connection ended (closed, failed, or the replica went away) first.
    #[error("the h2c connection to the replica ended")]
    Ended,
    #[error("the request's body failed before it was sent")]
    Body,
}

impl Error {
    /// The replica did not process the request: it may go to another.
    pub fn went_away(&self) -> bool {
        matches!(self, Error::Refused | Error::Ended)
    }
}

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
    /// The connection's task, once it is open.
    ctl: OnceCell<mpsc::UnboundedSender<Cmd>>,
    /// Set when the connection takes no more requests (ended, or going away).
    ended: AtomicBool,
    /// Requests on it whose answer has not ended (or been dropped).
    under_way: AtomicUsize,
    /// The replica's stream limit ([`ASSUMED_STREAMS`] until its settings arrive).
    limit: AtomicUsize,
    /// The key of the next request on it.
    next_key: AtomicU64,
}

impl Conn {
    fn new() -> Self {
        Conn {
            ctl: OnceCell::new(),
            ended: AtomicBool::new(false),
            under_way: AtomicUsize::new(0),
            limit: AtomicUsize::new(ASSUMED_STREAMS),
            next_key: AtomicU64::new(0),
        }
    }

    /// Whether another request may take it: it has not ended, and the replica allows another
    /// stream.
    fn has_room(&self) -> bool {
        !self.ended.load(Ordering::Acquire)
            && self.under_way.load(Ordering::Relaxed) < self.limit.load(Ordering::Relaxed)
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

/// Opens a connection to `addr` and starts its task.
async fn open(
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
    conn: &Arc<Conn>,
) -> Result<mpsc::UnboundedSender<Cmd>, SendError> {
    let replica = backends.find(addr);
    let sock = backends::connect(addr, dial.attempt_ms, dial.timeout_ms, replica.as_deref())
        .await
        .map_err(SendError::connect)?;
    let client = Client::new(Config {
        initial_window_size: STREAM_WINDOW,
        connection_window: CONN_WINDOW,
        max_header_list_size: dial.max_header_list_size,
    });
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(drive(
        sock,
        client,
        rx,
        conn.clone(),
        dial.idle_timeout_ms,
        dial.clock.clone(),
        addr,
    ));
    Ok(tx)
}

/// What a request's task (or its body's) tells its connection. `key`: the request's, on its
/// connection.
enum Cmd {
    Open(Box<Opening>),
    /// Part of the request's body; `credit`: the budget it took, returned once it is out.
    Data {
        key: u64,
        data: Bytes,
        end: bool,
        credit: Option<Credit>,
    },
    /// The request's trailers, ending it.
    Trailers {
        key: u64,
        fields: HeaderMap,
    },
    /// The request is abandoned: its stream is reset.
    Cancel {
        key: u64,
    },
    /// `n` bytes of the answer on `stream` were passed on.
    Consumed {
        stream: u32,
        n: usize,
    },
}

/// A request for a stream.
struct Opening {
    key: u64,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    /// What of its body had arrived, in order (data, trailers).
    body: Vec<Frame<Bytes>>,
    /// The body ends with what came.
    end: bool,
    answer: mpsc::UnboundedSender<Part>,
    /// Dropped when the stream ends: the task sending the rest of the body stops.
    stop: Option<oneshot::Sender<()>>,
}

/// What comes back of an answer.
enum Part {
    Head {
        stream: u32,
        status: u16,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
        end: bool,
    },
    Data {
        data: Bytes,
        end: bool,
    },
    Trailers(Vec<(Vec<u8>, Vec<u8>)>),
    Failed(Error),
}

/// A request on the connection.
struct Stream {
    /// Its stream, once opened (a request past the replica's limit waits for one).
    id: Option<u32>,
    answer: mpsc::UnboundedSender<Part>,
    waiting: VecDeque<Waiting>,
    /// The request's side ended (its last byte, or its trailers, went out).
    sent_end: bool,
    _stop: Option<oneshot::Sender<()>>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        release(std::mem::take(&mut self.waiting));
    }
}

/// A request's head, waiting for a stream; `end`: it has no body.
struct Head {
    key: u64,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    end: bool,
}

/// A connection's requests: by key, the opened ones by stream too, and the keys waiting for a
/// stream with their heads.
#[derive(Default)]
struct Streams {
    by_key: HashMap<u64, Stream>,
    keys: HashMap<u32, u64>,
    pending: VecDeque<Head>,
}

/// Drives one connection until it ends: reads the replica into the client side, takes the
/// requests' messages, writes what both make.
async fn drive(
    mut sock: TcpStream,
    mut client: Client,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    conn: Arc<Conn>,
    idle_ms: u64,
    clock: Arc<dyn Clock>,
    addr: SocketAddr,
) {
    let _open = Open::new();
    let progress = Progress::new(&*clock);
    let mut watchdog = Watchdog::new(&progress, idle_ms.max(1));
    let mut streams = Streams::default();
    let mut events = Vec::new();
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut busy_before = false;
    loop {
        if !buf.is_empty() {
            let read = client.recv(&buf, &mut events);
            for event in events.drain(..) {
                streams.on_event(event, &buf, &mut client);
            }
            match read {
                Ok(n) => buf.advance(n),
                Err(e) => {
                    tracing::debug!(%addr, error = ?e, "h2c connection to a replica failed");
                    buf.clear();
                }
            }
            if let Some(limit) = client.stream_limit() {
                conn.limit.store(limit as usize, Ordering::Relaxed);
            }
            if client.going_away() {
                conn.ended.store(true, Ordering::Release);
            }
            streams.start_pending(&mut client);
        }
        if h2parts::write_out(&mut sock, client.out()).await.is_err() {
            break;
        }
        if client.failed() || (client.going_away() && streams.by_key.is_empty()) {
            break;
        }
        if buf.capacity() - buf.len() < READ_CHUNK {
            buf.reserve(READ_CHUNK);
        }
        let idle = streams.by_key.is_empty();
        if idle && busy_before {
            // The idle bound counts from the last answer's end.
            progress.mark();
        }
        busy_before = !idle;
        tokio::select! {
            Some(first) = rx.recv() => {
                streams.on_cmd(first, &mut client);
                for _ in 1..CMD_BATCH {
                    match rx.try_recv() {
                        Ok(m) => streams.on_cmd(m, &mut client),
                        Err(_) => break,
                    }
                }
                streams.start_pending(&mut client);
            }
            r = sock.read_buf(&mut buf) => match r {
                Ok(n) if n > 0 => {}
                _ => break,
            },
            () = watchdog.expired(&progress, idle_ms), if idle && idle_ms > 0 => {
                // A request that took the connection may not have reached it yet.
                if conn.under_way.load(Ordering::Relaxed) == 0 {
                    tracing::debug!(%addr, "closing an idle h2c connection to a replica");
                    conn.ended.store(true, Ordering::Release);
                    client.go_away();
                    let _ = sock.write_all(client.out()).await;
                    break;
                }
                progress.mark();
            }
        }
    }
    conn.ended.store(true, Ordering::Release);
    // The requests still here see their answers' channels close: [`Error::Ended`].
}

impl Streams {
    /// Takes one thing the client side read.
    fn on_event(&mut self, event: Event, buf: &[u8], client: &mut Client) {
        match event {
            Event::Response {
                stream,
                head,
                end_stream,
            } => {
                if let Some(s) = self.keys.get(&stream).and_then(|k| self.by_key.get(k)) {
                    let _ = s.answer.send(Part::Head {
                        stream,
                        status: head.status,
                        fields: head.fields,
                        end: end_stream,
                    });
                    if end_stream {
                        self.answered(stream, client);
                    }
                }
            }
            Event::Data {
                stream,
                data,
                end_stream,
            } => {
                let n = data.len();
                let s = self.keys.get(&stream).and_then(|k| self.by_key.get(k));
                let passed = s.is_some_and(|s| {
                    s.answer
                        .send(Part::Data {
                            data: Bytes::copy_from_slice(&buf[data]),
                            end: end_stream,
                        })
                        .is_ok()
                });
                if !passed && n > 0 {
                    // Nobody reads the answer any more: its window goes back at once.
                    client.consumed(stream, n);
                }
                if end_stream {
                    self.answered(stream, client);
                }
            }
            Event::Trailers { stream, fields } => {
                if let Some(s) = self.keys.get(&stream).and_then(|k| self.by_key.get(k)) {
                    let _ = s.answer.send(Part::Trailers(fields));
                }
                self.answered(stream, client);
            }
            Event::Reset { stream, code } => {
                if let Some(s) = self
                    .keys
                    .remove(&stream)
                    .and_then(|k| self.by_key.remove(&k))
                {
                    let e = if code == ErrorCode::REFUSED_STREAM {
                        Error::Refused
                    } else {
                        Error::Reset(code)
                    };
                    let _ = s.answer.send(Part::Failed(e));
                }
            }
            Event::Writable { stream: 0 } => {
                let ready: Vec<u64> = self
                    .by_key
                    .iter()
                    .filter(|(_, s)| s.id.is_some() && !s.waiting.is_empty())
                    .map(|(k, _)| *k)
                    .collect();
                for key in ready {
                    self.flush(key, client);
                }
            }
            Event::Writable { stream } => {
                if let Some(&key) = self.keys.get(&stream) {
                    self.flush(key, client);
                }
            }
            // No new stream opens: those waiting for one go to another connection.
            Event::GoAway { .. } => {
                for head in std::mem::take(&mut self.pending) {
                    if let Some(s) = self.by_key.remove(&head.key) {
                        let _ = s.answer.send(Part::Failed(Error::Refused));
                    }
                }
            }
        }
    }

    /// The answer on `stream` is whole: a request body still going is not wanted any more.
    fn answered(&mut self, stream: u32, client: &mut Client) {
        if let Some(s) = self
            .keys
            .remove(&stream)
            .and_then(|k| self.by_key.remove(&k))
            && !s.sent_end
        {
            client.reset(stream, ErrorCode::CANCEL);
        }
    }

    /// Takes one message of a request's task.
    fn on_cmd(&mut self, cmd: Cmd, client: &mut Client) {
        match cmd {
            Cmd::Open(o) => {
                let Opening {
                    key,
                    method,
                    uri,
                    headers,
                    body,
                    end,
                    answer,
                    stop,
                } = *o;
                let mut waiting = VecDeque::with_capacity(body.len());
                let last = body.len().saturating_sub(1);
                for (i, frame) in body.into_iter().enumerate() {
                    match frame.into_data() {
                        Ok(data) => waiting.push_back(Waiting::Data {
                            data,
                            end: end && i == last,
                            credit: None,
                        }),
                        Err(f) => {
                            if let Ok(t) = f.into_trailers() {
                                waiting.push_back(Waiting::Trailers(t));
                            }
                        }
                    }
                }
                self.by_key.insert(
                    key,
                    Stream {
                        id: None,
                        answer,
                        waiting,
                        sent_end: false,
                        _stop: stop,
                    },
                );
                let head = Head {
                    key,
                    method,
                    uri,
                    headers,
                    end,
                };
                if self.pending.is_empty() {
                    self.start(head, client);
                } else {
                    self.pending.push_back(head);
                }
            }
            Cmd::Data {
                key,
                data,
                end,
                credit,
            } => {
                let w = Waiting::Data { data, end, credit };
                match self.by_key.get_mut(&key) {
                    Some(s) => {
                        s.waiting.push_back(w);
                        if s.id.is_some() {
                            self.flush(key, client);
                        }
                    }
                    None => release(VecDeque::from([w])),
                }
            }
            Cmd::Trailers { key, fields } => {
                if let Some(s) = self.by_key.get_mut(&key) {
                    s.waiting.push_back(Waiting::Trailers(fields));
                    if s.id.is_some() {
                        self.flush(key, client);
                    }
                }
            }
            Cmd::Cancel { key } => {
                if let Some(s) = self.by_key.remove(&key) {
                    match s.id {
                        Some(id) => {
                            self.keys.remove(&id);
                            client.reset(id, ErrorCode::CANCEL);
                        }
                        None => self.pending.retain(|h| h.key != key),
                    }
                }
            }
            Cmd::Consumed { stream, n } => client.consumed(stream, n),
        }
    }

    /// Opens the stream of the request `key` (already in `by_key`), or leaves it waiting for
    /// room under the replica's limit.
    fn start(&mut self, head: Head, client: &mut Client) {
        let key = head.key;
        let Some(s) = self.by_key.get_mut(&key) else {
            return;
        };
        let end_at_head = head.end && s.waiting.is_empty();
        let uri = &head.uri;
        let fields = head
            .headers
            .iter()
            .filter(|(n, v)| {
                !ebb_http::h2::connection_specific(n.as_str().as_bytes(), v.as_bytes())
            })
            .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()));
        let opened = client.request(
            head.method.as_str().as_bytes(),
            uri.scheme_str().unwrap_or("http").as_bytes(),
            uri.authority().map_or("", |a| a.as_str()).as_bytes(),
            uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes(),
            fields,
            end_at_head,
        );
        match opened {
            Ok(id) => {
                s.id = Some(id);
                s.sent_end = end_at_head;
                self.keys.insert(id, key);
                self.flush(key, client);
            }
            // The replica's limit is reached: the request waits for a stream to end.
            Err(_) if !client.failed() && !client.going_away() && client.open_streams() > 0 => {
                self.pending.push_front(head);
            }
            Err(_) => {
                if let Some(s) = self.by_key.remove(&key) {
                    let _ = s.answer.send(Part::Failed(Error::Refused));
                }
            }
        }
    }

    /// Opens the streams of the requests waiting for room, while there is.
    fn start_pending(&mut self, client: &mut Client) {
        while !self.pending.is_empty() && client.can_open() {
            let head = self.pending.pop_front().expect("not empty");
            self.start(head, client);
        }
    }

    /// Writes what of request `key`'s body the windows let go.
    fn flush(&mut self, key: u64, client: &mut Client) {
        let Some(s) = self.by_key.get_mut(&key) else {
            return;
        };
        let Some(id) = s.id else {
            return;
        };
        match h2parts::flush(client, id, &mut s.waiting) {
            Flushed::Waiting => {}
            Flushed::Ended => s.sent_end = true,
            // The stream is gone (its answer ended): nothing more goes on it.
            Flushed::Gone => release(std::mem::take(&mut s.waiting)),
        }
    }
}

/// A connection to `addr` with room for the request, open: opened when there is none (and once
/// more when the one found had ended under it).
async fn ready_conn(
    addr: SocketAddr,
    dial: Dial<'_>,
    backends: &Backends,
) -> Result<(mpsc::UnboundedSender<Cmd>, UnderWay), SendError> {
    let under_way = conn_for(addr);
    let conn = &under_way.0;
    // Boxed: the opening's state is not every request's.
    match conn
        .ctl
        .get_or_try_init(|| Box::pin(open(addr, dial, backends, conn)))
        .await
    {
        Ok(ctl) => Ok((ctl.clone(), under_way)),
        Err(e) => {
            conn.ended.store(true, Ordering::Release);
            Err(e)
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
) -> Result<Response<Body>, SendError> {
    let (mut ctl, mut under_way) = match ready_conn(addr, dial, backends).await {
        Ok(c) => c,
        // Not connected: the request goes back whole, for another try.
        Err(e) => return Err(e.unsent(req)),
    };
    let (parts, mut body) = req.into_parts();
    // What of the body is here already goes with the head.
    let mut early = Vec::new();
    let mut end = body.is_end_stream();
    if !end {
        let mut failed = false;
        std::future::poll_fn(|cx| {
            let mut taken = 0;
            while taken < EAGER_MAX {
                match Pin::new(&mut body).poll_frame(cx) {
                    Poll::Pending => break,
                    Poll::Ready(None) => {
                        end = true;
                        break;
                    }
                    Poll::Ready(Some(Err(_))) => {
                        failed = true;
                        break;
                    }
                    Poll::Ready(Some(Ok(frame))) => {
                        taken += frame.data_ref().map_or(0, Bytes::len);
                        let trailers = frame.is_trailers();
                        early.push(frame);
                        if trailers || body.is_end_stream() {
                            end = true;
                            break;
                        }
                    }
                }
            }
            Poll::Ready(())
        })
        .await;
        if failed {
            return Err(Error::Body.into());
        }
    }
    let (answer, mut answers) = mpsc::unbounded_channel();
    let (stop, stopped) = if end {
        (None, None)
    } else {
        let (tx, rx) = oneshot::channel();
        (Some(tx), Some(rx))
    };
    let mut opening = Box::new(Opening {
        key: 0,
        method: parts.method,
        uri: parts.uri,
        headers: parts.headers,
        body: early,
        end,
        answer,
        stop,
    });
    // A connection that ended under the request (its task gone) is replaced once.
    let mut tried_fresh = false;
    let key = loop {
        let key = under_way.0.next_key.fetch_add(1, Ordering::Relaxed);
        opening.key = key;
        match ctl.send(Cmd::Open(opening)) {
            Ok(()) => break key,
            Err(mpsc::error::SendError(cmd)) => {
                under_way.0.ended.store(true, Ordering::Release);
                let Cmd::Open(o) = cmd else {
                    unreachable!("the message sent was an opening")
                };
                opening = o;
                if tried_fresh {
                    return Err(Error::Ended.into());
                }
                tried_fresh = true;
                (ctl, under_way) = ready_conn(addr, dial, backends).await?;
            }
        }
    };
    let mut guard = Abandon {
        ctl: ctl.clone(),
        key,
        armed: true,
    };
    if let Some(stopped) = stopped {
        tokio::spawn(pipe(body, key, ctl.clone(), stopped));
    }
    let (stream, status, fields, end) = match answers.recv().await {
        Some(Part::Head {
            stream,
            status,
            fields,
            end,
        }) => (stream, status, fields, end),
        Some(Part::Failed(e)) => {
            guard.armed = false;
            return Err(e.into());
        }
        Some(Part::Data { .. } | Part::Trailers(_)) | None => {
            guard.armed = false;
            return Err(Error::Ended.into());
        }
    };
    let mut resp = Response::new(if end {
        guard.armed = false;
        super::empty()
    } else {
        AnswerBody {
            answers,
            stream,
            guard,
            _under_way: under_way,
        }
        .boxed()
    });
    *resp.status_mut() =
        hyper::StatusCode::from_u16(status).map_err(|_| Error::Reset(ErrorCode::PROTOCOL_ERROR))?;
    *resp.version_mut() = hyper::Version::HTTP_2;
    *resp.headers_mut() = header_map(fields);
    Ok(resp)
}

/// Resets the stream of a request abandoned (its task dropped before its answer ended).
struct Abandon {
    ctl: mpsc::UnboundedSender<Cmd>,
    key: u64,
    armed: bool,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.ctl.send(Cmd::Cancel { key: self.key });
        }
    }
}

/// Sends on the rest of a request's body, each part taking credit from the stream's budget:
/// its data, then its trailers or its end. A body that fails resets the stream; the stream's
/// end (`stop` dropped by the connection) ends it.
async fn pipe(
    mut body: Body,
    key: u64,
    ctl: mpsc::UnboundedSender<Cmd>,
    mut stop: oneshot::Receiver<()>,
) {
    let budget = Arc::new(Semaphore::new(BODY_BUDGET));
    loop {
        let frame = tokio::select! {
            biased;
            _ = &mut stop => return,
            f = body.frame() => f,
        };
        let frame = match frame {
            None => {
                let _ = ctl.send(Cmd::Data {
                    key,
                    data: Bytes::new(),
                    end: true,
                    credit: None,
                });
                return;
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "a request body failed; resetting its h2c stream");
                let _ = ctl.send(Cmd::Cancel { key });
                return;
            }
            Some(Ok(f)) => f,
        };
        match frame.into_data() {
            Ok(data) => {
                let end = body.is_end_stream();
                let n = data.len().clamp(1, BODY_BUDGET) as u32;
                let permits = tokio::select! {
                    biased;
                    _ = &mut stop => return,
                    p = budget.acquire_many(n) => p,
                };
                let Ok(permits) = permits else {
                    return;
                };
                permits.forget();
                let _ = ctl.send(Cmd::Data {
                    key,
                    data,
                    end,
                    credit: Some((budget.clone(), n)),
                });
                if end {
                    return;
                }
            }
            Err(frame) => {
                if let Ok(fields) = frame.into_trailers() {
                    let _ = ctl.send(Cmd::Trailers { key, fields });
                    return;
                }
            }
        }
    }
}

/// An answer's body: the data the replica sent, each part's window given back as it is passed
/// on, then its trailers.
struct AnswerBody {
    answers: mpsc::UnboundedReceiver<Part>,
    stream: u32,
    /// Armed until the answer ends: dropped before, the stream is reset.
    guard: Abandon,
    _under_way: UnderWay,
}

impl hyper::body::Body for AnswerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if !self.guard.armed {
            return Poll::Ready(None);
        }
        let part = match self.answers.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(p) => p,
        };
        match part {
            Some(Part::Data { data, end }) => {
                if end {
                    self.guard.armed = false;
                }
                if !data.is_empty() {
                    let _ = self.guard.ctl.send(Cmd::Consumed {
                        stream: self.stream,
                        n: data.len(),
                    });
                } else if end {
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Some(Part::Trailers(fields)) => {
                self.guard.armed = false;
                Poll::Ready(Some(Ok(Frame::trailers(header_map(fields)))))
            }
            Some(Part::Failed(e)) => {
                self.guard.armed = false;
                Poll::Ready(Some(Err(e.into())))
            }
            Some(Part::Head { .. }) | None => {
                self.guard.armed = false;
                Poll::Ready(Some(Err(Error::Ended.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        !self.guard.armed
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for AnswerBody {
    fn drop(&mut self) {
        // What came and was never passed on gives its window back.
        let n = h2parts::unread(&mut self.answers, |part| match part {
            Part::Data { data, .. } => data.len(),
            _ => 0,
        });
        if n > 0 {
            let _ = self.guard.ctl.send(Cmd::Consumed {
                stream: self.stream,
                n,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use hyper::header;

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

    async fn answer(r: Result<Response<Body>, SendError>) -> (String, Option<HeaderMap>) {
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
                        .filter(|c| c.limit.load(Ordering::Relaxed) == 1)
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

    /// A replica that answers each connection's first request with SETTINGS and a GOAWAY taking
    /// no stream, then closes; with the connections it accepted.
    async fn going_away_server() -> (SocketAddr, Arc<AtomicUsize>) {
        use ebb_http::h2;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let a = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    // The preface, then frames until a HEADERS one.
                    let headers_came = |buf: &[u8]| {
                        let mut at = h2::PREFACE.len();
                        while let Ok(Some((frame, used))) =
                            h2::read(&buf[at.min(buf.len())..], 1 << 14)
                        {
                            if matches!(frame, h2::Frame::Headers { .. }) {
                                return true;
                            }
                            at += used;
                        }
                        false
                    };
                    while buf.len() < h2::PREFACE.len() || !headers_came(&buf) {
                        if tcp.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                    let mut out = Vec::new();
                    h2::write_settings(&mut out, &[]);
                    h2::write_goaway(&mut out, 0, h2::ErrorCode::NO_ERROR, b"");
                    tcp.write_all(&out).await.unwrap();
                    // Until the client closes.
                    while tcp.read_buf(&mut buf).await.unwrap_or(0) > 0 {}
                });
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn a_stream_past_the_replicas_goaway_is_refused_and_the_next_request_connects_again() {
        let (addr, accepted) = going_away_server().await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 0);
        let backends = Backends::default();
        for n in 1..=2 {
            let empty = http_body_util::Empty::new().map_err(|e| match e {}).boxed();
            let e = send(request(addr, empty), addr, dial, &backends)
                .await
                .unwrap_err();
            assert!(matches!(e, SendError::H2(Error::Refused)), "{e}");
            assert!(
                crate::backend_went_away(&e),
                "not processed: it may go elsewhere"
            );
            assert_eq!(accepted.load(Ordering::SeqCst), n, "a connection each");
        }
        until("the connections going away end", || {
            CONNS.with(|c| {
                c.borrow()
                    .get(&addr)
                    .is_none_or(|l| l.iter().all(|c| c.ended.load(Ordering::Acquire)))
            })
        })
        .await;
    }

    #[tokio::test]
    async fn an_abandoned_request_and_an_answer_dropped_halfway_reset_their_streams() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (held, resets) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(std::sync::Mutex::new(Vec::new())),
        );
        let (h, r) = (held.clone(), resets.clone());
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(tcp).await.unwrap();
            while let Some(Ok((req, mut respond))) = conn.accept().await {
                let (h, r) = (h.clone(), r.clone());
                tokio::spawn(async move {
                    let path = req.uri().path().to_owned();
                    // `/hold` never answers; `/half` sends a head and part of a body.
                    let reason = if path == "/hold" {
                        h.fetch_add(1, Ordering::SeqCst);
                        std::future::poll_fn(|cx| respond.poll_reset(cx)).await
                    } else {
                        let mut tx = respond.send_response(Response::new(()), false).unwrap();
                        tx.send_data(Bytes::from_static(b"part"), false).unwrap();
                        std::future::poll_fn(|cx| tx.poll_reset(cx)).await
                    };
                    r.lock().unwrap().push((path, reason.unwrap()));
                });
            }
        });
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 0);
        let backends = Backends::default();
        let get = |path: &str| {
            Request::get(format!("http://{addr}{path}"))
                .body(http_body_util::Empty::new().map_err(|e| match e {}).boxed())
                .unwrap()
        };
        // The client leaves while its request is held: the future is dropped.
        tokio::select! {
            r = send(get("/hold"), addr, dial, &backends) => panic!("answered: {:?}", r.map(|_| ())),
            () = until("the request is held", || held.load(Ordering::SeqCst) == 1) => {}
        }
        until("the held stream is reset", || {
            resets.lock().unwrap().len() == 1
        })
        .await;
        // The answer's body is dropped after its first part.
        let mut body = send(get("/half"), addr, dial, &backends)
            .await
            .unwrap()
            .into_body();
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "part");
        drop(body);
        until("the half-read stream is reset", || {
            resets.lock().unwrap().len() == 2
        })
        .await;
        let resets = resets.lock().unwrap().clone();
        assert_eq!(
            resets,
            [
                ("/hold".to_owned(), h2::Reason::CANCEL),
                ("/half".to_owned(), h2::Reason::CANCEL)
            ]
        );
    }

    /// An h2c server echoing each request's body back as it comes, in the `h2` crate's default
    /// windows (65,535 bytes), releasing what it read only once it has been sent on.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut conn = h2::server::handshake(tcp).await.unwrap();
                    while let Some(Ok((req, mut respond))) = conn.accept().await {
                        tokio::spawn(async move {
                            let mut body = req.into_body();
                            let mut tx = respond.send_response(Response::new(()), false).unwrap();
                            while let Some(Ok(d)) = body.data().await {
                                let n = d.len();
                                tx.reserve_capacity(n);
                                let mut d = d;
                                while !d.is_empty() {
                                    let room = std::future::poll_fn(|cx| tx.poll_capacity(cx))
                                        .await
                                        .unwrap()
                                        .unwrap();
                                    let chunk = d.split_to(room.min(d.len()));
                                    tx.send_data(chunk, false).unwrap();
                                }
                                let _ = body.flow_control().release_capacity(n);
                            }
                            let mut trailers = HeaderMap::new();
                            trailers.insert("grpc-status", "0".parse().unwrap());
                            tx.send_trailers(trailers).unwrap();
                        });
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn bodies_larger_than_every_window_go_both_ways_whole() {
        let addr = echo_server().await;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let dial = backends::tests::dial(&clock, 0);
        let backends = Backends::default();
        // Two calls at once, each 6 MiB in 64 KiB parts: past this side's stream window (2 MiB)
        // and connection window (5 MiB) and the replica's windows; the parts differ so that a
        // part lost, repeated or reordered shows.
        let call = |seed: u8| {
            let (more, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
            let mut rx = rx;
            let body =
                StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))).boxed();
            let sent: Vec<u8> = (0..96u32 * 65_536)
                .map(|i| (i / 65_536) as u8 ^ seed)
                .collect();
            let feed = {
                let sent = sent.clone();
                async move {
                    for part in sent.chunks(65_536) {
                        more.send(Ok(Frame::data(Bytes::copy_from_slice(part))))
                            .await
                            .unwrap();
                    }
                }
            };
            let backends = &backends;
            let answer = async move {
                let collected = send(request(addr, body), addr, dial, backends)
                    .await
                    .unwrap()
                    .into_body()
                    .collect()
                    .await
                    .unwrap();
                let trailers = collected.trailers().cloned().unwrap();
                (collected.to_bytes(), trailers)
            };
            async move {
                let ((got, trailers), ()) = tokio::join!(answer, feed);
                assert_eq!(trailers["grpc-status"], "0");
                assert!(got == sent, "the echo of call {seed} differs");
            }
        };
        tokio::join!(call(1), call(2));
    }
}
