//! Byte splicing between two connections with an idle bound: a TCP route's connection
//! ([`splice_tcp`]: two sockets, in a copy loop of its own) and an upgraded connection
//! (WebSocket; [`splice`]: any two streams, through tokio's copy). Every read that moves bytes
//! marks the pair's last activity (by ebb's clock; every byte written was read first, so reads
//! alone tell when bytes last moved, at one clock read per chunk); one timer, moved only when it
//! fires, ends the splice once nothing moved for the bound (the route's
//! `connection_idle_timeout_ms`).
//!
//! The copy loop makes the syscalls HAProxy's `mode tcp` makes (measured with redis-benchmark:
//! two `recvfrom` and two `sendto` per unpipelined request, one of each per pipelined batch),
//! the least a user-space copy can. Handing the pair to the kernel instead (a `SOCKHASH` and an
//! `sk_skb` verdict program redirecting each socket's bytes to the other) was measured slower
//! without pipelining, 0.89-0.93x HAProxy: a redirect to a socket's egress is sent by a kernel
//! worker, a context switch per hop. With pipelining it gained nothing over this loop, and it
//! would need unsafe `bpf(2)` calls and a drain check before passing on each FIN.

use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{ReadHalf, WriteHalf};

use crate::clock::Clock;

/// How a splice ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// Both sides closed: bytes moved each way.
    Closed { up: u64, down: u64 },
    /// Nothing moved either way for the idle bound.
    Idle,
}

/// Copies bytes both ways between `a` and `b` until both are done, or until nothing moved for
/// `idle` (none: no bound) by `clock`.
pub async fn splice<A, B>(
    a: A,
    b: B,
    idle: Option<Duration>,
    clock: &dyn Clock,
) -> io::Result<Ended>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let last = AtomicU64::new(clock.now_ms());
    let mut a = Marked {
        inner: a,
        clock,
        last: &last,
    };
    let mut b = Marked {
        inner: b,
        clock,
        last: &last,
    };
    let copy = tokio::io::copy_bidirectional(&mut a, &mut b);
    bounded(copy, &last, idle, clock).await
}

/// [`splice`] for two TCP sockets (a TCP route's connection): the same copying, in a loop of
/// its own whose buffers are held only while bytes are in flight (`FLOW_BUF`): an open
/// connection that moves nothing holds none (tokio's copy keeps 8 KiB a way for the connection's
/// life: 72 MB for 4,000 idle connections, against 10 MB here).
pub async fn splice_tcp(
    mut a: TcpStream,
    mut b: TcpStream,
    idle: Option<Duration>,
    clock: &dyn Clock,
) -> io::Result<Ended> {
    let last = AtomicU64::new(clock.now_ms());
    let mark = || {
        last.fetch_max(clock.now_ms(), Ordering::Relaxed);
    };
    let (mut a_read, mut a_write) = a.split();
    let (mut b_read, mut b_write) = b.split();
    let mut up = Flow::new();
    let mut down = Flow::new();
    let copy = std::future::poll_fn(|cx| {
        let up = up.poll(cx, &mut a_read, &mut b_write, &mark)?;
        let down = down.poll(cx, &mut b_read, &mut a_write, &mark)?;
        match (up, down) {
            (Poll::Ready(up), Poll::Ready(down)) => Poll::Ready(Ok((up, down))),
            _ => Poll::Pending,
        }
    });
    bounded(copy, &last, idle, clock).await
}

/// Each way's buffer in [`splice_tcp`]. It is taken from the thread's spares when a read is to
/// be made and given back once its bytes are written on, as HAProxy does with its buffers: a
/// connection with nothing in flight holds none, and the few buffers that a thread's connections
/// use in turn are the same ones.
pub(crate) const FLOW_BUF: usize = 16 * 1024;

/// Spare buffers kept per thread; more are freed.
const SPARE_BUFS: usize = 64;

thread_local! {
    static SPARES: RefCell<Vec<Box<[u8]>>> = const { RefCell::new(Vec::new()) };
}

fn take_buf() -> Box<[u8]> {
    SPARES
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_else(|| vec![0; FLOW_BUF].into_boxed_slice())
}

fn give_back(buf: Box<[u8]>) {
    // At the thread's end the spares are gone: the buffer is freed.
    let _ = SPARES.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < SPARE_BUFS {
            s.push(buf);
        }
    });
}

/// One way of a [`splice_tcp`]: the bytes read and not yet written on.
struct Flow {
    /// Holds `filled` bytes read, of which `written` are written on; none once all are.
    buf: Option<Box<[u8]>>,
    written: usize,
    filled: usize,
    /// The reading side ended (its peer closed its way).
    eof: bool,
    /// The writing side is shut down too: this way is over.
    done: bool,
    moved: u64,
}

impl Drop for Flow {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            give_back(buf);
        }
    }
}

impl Flow {
    fn new() -> Self {
        Flow {
            buf: None,
            written: 0,
            filled: 0,
            eof: false,
            done: false,
            moved: 0,
        }
    }

    /// Moves what `from` has to `to` until one of them must wait, or until `from` ended and `to`
    /// is shut down for writing (then: the bytes moved).
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut ReadHalf<'_>,
        to: &mut WriteHalf<'_>,
        mark: &impl Fn(),
    ) -> Poll<io::Result<u64>> {
        loop {
            if self.done {
                return Poll::Ready(Ok(self.moved));
            }
            if let Some(buf) = &self.buf {
                while self.written < self.filled {
                    let n =
                        ready!(Pin::new(&mut *to).poll_write(cx, &buf[self.written..self.filled]))?;
                    if n == 0 {
                        return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                    }
                    self.written += n;
                    self.moved += n as u64;
                }
            }
            if let Some(buf) = self.buf.take() {
                give_back(buf);
            }
            if self.eof {
                ready!(Pin::new(&mut *to).poll_shutdown(cx))?;
                self.done = true;
                continue;
            }
            // A buffer is taken only once the socket has bytes (or its end) to read; tokio's
            // read treats a short read as having drained the socket until its next event.
            ready!(from.as_ref().poll_read_ready(cx))?;
            let mut buf = take_buf();
            let mut read = ReadBuf::new(&mut buf);
            let got = match Pin::new(&mut *from).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) => read.filled().len(),
                Poll::Ready(Err(e)) => {
                    give_back(buf);
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {
                    give_back(buf);
                    return Poll::Pending;
                }
            };
            if got == 0 {
                give_back(buf);
                self.eof = true;
                continue;
            }
            mark();
            self.buf = Some(buf);
            self.written = 0;
            self.filled = got;
        }
    }
}

/// Runs `copy` until it ends, or until nothing moved (`last`, by `clock`) for `idle`.
async fn bounded(
    copy: impl std::future::Future<Output = io::Result<(u64, u64)>>,
    last: &AtomicU64,
    idle: Option<Duration>,
    clock: &dyn Clock,
) -> io::Result<Ended> {
    let Some(idle) = idle else {
        let (up, down) = copy.await?;
        return Ok(Ended::Closed { up, down });
    };
    let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
    tokio::pin!(copy);
    let mut wait = idle;
    loop {
        tokio::select! {
            r = &mut copy => {
                let (up, down) = r?;
                return Ok(Ended::Closed { up, down });
            }
            () = tokio::time::sleep(wait) => {
                let due = last.load(Ordering::Relaxed).saturating_add(idle_ms);
                let now = clock.now_ms();
                if now >= due {
                    return Ok(Ended::Idle);
                }
                wait = Duration::from_millis(due - now);
            }
        }
    }
}

/// A side of a splice that marks when it last moved bytes.
struct Marked<'a, T> {
    inner: T,
    clock: &'a dyn Clock,
    last: &'a AtomicU64,
}

impl<T> Marked<'_, T> {
    fn mark(&self) {
        self.last.fetch_max(self.clock.now_ms(), Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Marked<'_, T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.mark();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Marked<'_, T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn an_idle_pair_ends_and_a_busy_one_does_not() {
        let clock = std::sync::Arc::new(crate::clock::SimClock::new(1_000));
        let (a, mut a_peer) = tokio::io::duplex(64);
        let (b, mut b_peer) = tokio::io::duplex(64);
        let c = clock.clone();
        let splice =
            tokio::spawn(async move { splice(a, b, Some(Duration::from_secs(10)), &*c).await });
        // Both clocks move together: ebb's (which the marks read) and the timers'.
        let step = |ms: u64| {
            let clock = clock.clone();
            async move {
                clock.advance(ms);
                tokio::time::advance(Duration::from_millis(ms)).await;
            }
        };
        for _ in 0..5 {
            step(6_000).await;
            a_peer.write_all(b"ping").await.unwrap();
            let mut got = [0u8; 4];
            b_peer.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
        }
        assert!(!splice.is_finished(), "bytes moved every 6 s");
        step(9_000).await;
        assert!(!splice.is_finished(), "9 s without a byte");
        step(1_000).await;
        assert_eq!(splice.await.unwrap().unwrap(), Ended::Idle);
    }

    #[tokio::test]
    async fn a_pair_that_closes_reports_its_bytes() {
        let (a, mut a_peer) = tokio::io::duplex(64);
        let (b, mut b_peer) = tokio::io::duplex(64);
        let splice =
            tokio::spawn(async move { splice(a, b, None, &crate::clock::SystemClock).await });
        a_peer.write_all(b"hello").await.unwrap();
        a_peer.shutdown().await.unwrap();
        let mut got = Vec::new();
        b_peer.read_to_end(&mut got).await.unwrap();
        b_peer.shutdown().await.unwrap();
        assert_eq!(got, b"hello");
        assert_eq!(
            splice.await.unwrap().unwrap(),
            Ended::Closed { up: 5, down: 0 }
        );
    }

    #[tokio::test]
    async fn a_tcp_splice_carries_small_exchanges_and_bulk_both_ways() {
        let (a, client) = checks::tcp_pair().await;
        let (server, b) = checks::tcp_pair().await;
        let splice = tokio::spawn(async move {
            splice_tcp(
                a,
                b,
                Some(Duration::from_secs(60)),
                &crate::clock::SystemClock,
            )
            .await
        });
        checks::exchanges_and_bulk(client, server, || {
            // Nothing in flight: the buffers the splice read into are back among the thread's
            // spares (the test's runtime is this one thread), not held by the open connection.
            assert!(SPARES.with(|s| !s.borrow().is_empty()));
        })
        .await;
        assert_eq!(splice.await.unwrap().unwrap(), checks::EXCHANGED_AND_BULK);
    }

    #[tokio::test]
    async fn an_idle_tcp_splice_ends_and_closes_both_sides() {
        let (a, client) = checks::tcp_pair().await;
        let (server, b) = checks::tcp_pair().await;
        let idle = Some(checks::IDLE);
        let splice = splice_tcp(a, b, idle, &crate::clock::SystemClock);
        checks::ends_idle_and_closes(splice, client, server).await;
    }

    #[test]
    fn buffers_are_reused_and_the_spares_are_bounded() {
        let first = take_buf();
        let at = first.as_ptr();
        give_back(first);
        let again = take_buf();
        assert_eq!(
            again.as_ptr(),
            at,
            "the buffer given back is the next one taken"
        );
        let many: Vec<_> = (0..SPARE_BUFS + 5).map(|_| take_buf()).collect();
        many.into_iter().for_each(give_back);
        give_back(again);
        assert_eq!(SPARES.with(|s| s.borrow().len()), SPARE_BUFS);
    }
}

/// Loopback pairs and the traffic a TCP splice is checked with: the copy loop's tests here and
/// the relay's ([`super::relay`]).
#[cfg(test)]
pub(crate) mod checks {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::Ended;

    /// A connected pair of loopback sockets: (the accepted side, the connecting side).
    pub async fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, connected) = tokio::join!(listener.accept(), TcpStream::connect(addr));
        (accepted.unwrap().0, connected.unwrap())
    }

    /// How a splice that carried [`exchanges_and_bulk`] ends.
    pub const EXCHANGED_AND_BULK: Ended = Ended::Closed {
        up: 2_000 * 4 + 3_000_000,
        down: 2_000 * 4 + 2_000_000,
    };

    /// Through a splice from `client` to `server`: 2,000 small exchanges (every read short, so
    /// each leaves its socket drained: a readiness cleared wrongly would hang the next one), then
    /// `between`, then bulk far past a buffer's size both ways at once, and each side closes its
    /// way. Every byte must arrive in order.
    pub async fn exchanges_and_bulk(
        mut client: TcpStream,
        mut server: TcpStream,
        between: impl FnOnce(),
    ) {
        let exchanges = async {
            for i in 0..2_000u32 {
                let ask = i.to_be_bytes();
                client.write_all(&ask).await.unwrap();
                let mut got = [0u8; 4];
                server.read_exact(&mut got).await.unwrap();
                assert_eq!(got, ask);
                server.write_all(&got).await.unwrap();
                client.read_exact(&mut got).await.unwrap();
                assert_eq!(got, ask);
            }
        };
        tokio::time::timeout(Duration::from_secs(60), exchanges)
            .await
            .expect("the exchanges went through");
        between();
        let up: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..2_000_000u32).map(|i| (i % 241) as u8).collect();
        let (mut client_read, mut client_write) = client.split();
        let (mut server_read, mut server_write) = server.split();
        let send_up = async {
            client_write.write_all(&up).await.unwrap();
            client_write.shutdown().await.unwrap();
        };
        let send_down = async {
            server_write.write_all(&down).await.unwrap();
            server_write.shutdown().await.unwrap();
        };
        let mut got_up = Vec::new();
        let mut got_down = Vec::new();
        let bulk = async {
            tokio::join!(
                send_up,
                send_down,
                server_read.read_to_end(&mut got_up),
                client_read.read_to_end(&mut got_down),
            )
        };
        let (_, _, read_up, read_down) = tokio::time::timeout(Duration::from_secs(60), bulk)
            .await
            .expect("the bulk went through");
        read_up.unwrap();
        read_down.unwrap();
        assert!(got_up == up, "the bytes up arrived whole and in order");
        assert!(
            got_down == down,
            "the bytes down arrived whole and in order"
        );
    }

    /// The idle bound the idle tests give a splice.
    pub const IDLE: Duration = Duration::from_millis(50);

    /// `splice` (of `client`'s and `server`'s peers, bounded by [`IDLE`]) ends idle, and both
    /// peers read its end of stream.
    pub async fn ends_idle_and_closes(
        splice: impl Future<Output = std::io::Result<Ended>>,
        client: TcpStream,
        server: TcpStream,
    ) {
        let ended = tokio::time::timeout(Duration::from_secs(30), splice)
            .await
            .expect("the splice ended");
        assert_eq!(ended.unwrap(), Ended::Idle);
        both_closed(client, server).await;
    }

    /// Both peers of an ended splice read its end of stream.
    pub async fn both_closed(mut client: TcpStream, mut server: TcpStream) {
        let mut rest = Vec::new();
        let closed = async {
            assert_eq!(client.read_to_end(&mut rest).await.unwrap(), 0);
            assert_eq!(server.read_to_end(&mut rest).await.unwrap(), 0);
        };
        tokio::time::timeout(Duration::from_secs(30), closed)
            .await
            .expect("both sides closed");
    }
}
