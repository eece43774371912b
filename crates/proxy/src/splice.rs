//! Byte splicing between two connections with an idle bound: a TCP route's connection, and an
//! upgraded connection (WebSocket). Each side is wrapped so that every read that moves bytes
//! marks the pair's last activity (by ebb's clock; every byte written was read first, so reads
//! alone tell when bytes last moved, at one clock read per chunk); one timer, moved only when it
//! fires, ends the splice once nothing moved for the bound (the route's
//! `connection_idle_timeout_ms`).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::clock::Clock;

/// How a splice ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// Both sides closed (or one failed): bytes moved each way.
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
}
