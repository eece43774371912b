//! The stream-idle bound of the general path (HTTP/2 streams, gRPC's among them, and HTTP/1.0):
//! a request under way whose bodies move no frame either way for the route's
//! `stream_idle_timeout_ms` (else the proxy's `--request-stall-timeout-ms`) is cut: before the
//! answer's head with a 504 (a gRPC `DEADLINE_EXCEEDED`), after it by ending the answer's body with
//! an error (the stream is reset, the connection of an HTTP/1.x answer closed).
//!
//! Both bodies mark one shared time of the last frame, by ebb's clock; the response's body holds
//! one timer, moved only when it fires (as the HTTP/1.1 path's watchdog).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use super::{Body, BoxError};
use crate::clock::Clock;

/// When a request's bodies last moved a frame.
#[derive(Clone)]
pub struct Progress {
    clock: Arc<dyn Clock>,
    at_ms: Arc<AtomicU64>,
    limit_ms: u64,
}

impl Progress {
    /// Starts counting now, for a bound of `limit_ms`.
    pub fn new(clock: Arc<dyn Clock>, limit_ms: u64) -> Self {
        Self {
            at_ms: Arc::new(AtomicU64::new(clock.now_ms())),
            clock,
            limit_ms: limit_ms.max(1),
        }
    }

    fn mark(&self) {
        self.at_ms.fetch_max(self.clock.now_ms(), Ordering::Relaxed);
    }

    /// Restarts the bound now (a replica was found: the hold is not idleness).
    pub fn mark_now(&self) {
        self.mark();
    }

    /// How long until the bound passes with no frame (zero: it has).
    fn left(&self) -> Duration {
        let due = self
            .at_ms
            .load(Ordering::Relaxed)
            .saturating_add(self.limit_ms);
        Duration::from_millis(due.saturating_sub(self.clock.now_ms()))
    }

    /// Resolves once the bound passed with no frame moving.
    pub async fn stalled(&self) {
        loop {
            let left = self.left();
            if left.is_zero() {
                return;
            }
            tokio::time::sleep(left).await;
        }
    }

    /// The bound, in milliseconds.
    pub fn limit_ms(&self) -> u64 {
        self.limit_ms
    }
}

/// A body whose frames mark `progress`: the request's, on its way to the replica.
pub struct Marking {
    pub inner: Body,
    pub progress: Progress,
}

impl HttpBody for Marking {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &r {
            self.progress.mark();
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The answer's body under the bound: its frames mark `progress`, and once the bound passes with
/// no frame either way it ends with an error, counted by `on_stall`.
pub struct Bounded {
    pub inner: Body,
    pub progress: Progress,
    pub timer: Option<Pin<Box<tokio::time::Sleep>>>,
    pub on_stall: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Bounded {
    pub fn new(inner: Body, progress: Progress, on_stall: Box<dyn FnOnce() + Send + Sync>) -> Self {
        Self {
            inner,
            progress,
            timer: None,
            on_stall: Some(on_stall),
        }
    }
}

impl HttpBody for Bounded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.progress.mark();
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Pending => {}
            other => return other,
        }
        loop {
            let left = this.progress.left();
            if left.is_zero() {
                if let Some(f) = this.on_stall.take() {
                    f();
                }
                let limit = this.progress.limit_ms();
                return Poll::Ready(Some(Err(format!(
                    "the stream moved no frame either way for {limit} ms (stream_idle_timeout_ms)"
                )
                .into())));
            }
            // One timer, moved only when it fires early: frames that came meanwhile pushed the
            // bound further.
            let timer = this
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(left)));
            match timer.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) => this.timer = None,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
