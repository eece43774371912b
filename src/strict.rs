//! The HTTP/1 framing rules of the proxy's own parser, in front of hyper on ebb's endpoints. hyper
//! takes a lone LF as a line's end and decides framing by itself; this reader sees every request
//! head before hyper does and ends the connection at one that is ambiguous: a line ending in LF
//! alone, a NUL or other control byte, both Content-Length and Transfer-Encoding, Content-Lengths
//! that disagree or do not parse, a Transfer-Encoding other than `chunked`, obsolete line folding.
//! It follows each body (by its Content-Length or its chunks) to find the next head, and passes
//! every byte on unchanged.
//!
//! It sits under hyper on every connection of the admin address: [`StrictListener`] for plain
//! TCP, and inside `tls::TlsListener` after the handshake. The framing itself is `ebb_http`'s.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use ebb_http::chunked::Chunked;

/// The longest head read; the connection ends at a longer one.
const MAX_HEAD: usize = 64 * 1024;
/// Header lines read per head.
const MAX_HEADERS: usize = 100;

#[derive(Debug)]
enum State {
    /// Reading a head.
    Head,
    /// Passing `n` more body bytes.
    Body(u64),
    /// Passing a chunked body.
    Chunks(Chunked),
    /// After an upgrade: everything passes.
    Through,
    /// Refused: the connection ends.
    Refused(&'static str),
}

/// A connection's reading side, checked head by head.
pub struct Strict<S> {
    inner: S,
    state: State,
    /// Bytes read from `inner`; the first `ready` are checked and may be handed on.
    buf: BytesMut,
    ready: usize,
}

impl<S> Strict<S> {
    /// Checks what is read from `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            state: State::Head,
            buf: BytesMut::with_capacity(8 * 1024),
            ready: 0,
        }
    }
}

/// What a complete head says of the connection after it, or why it is refused.
fn check_head(head: &[u8]) -> Result<State, &'static str> {
    if ebb_http::h1::bare_lf(head) {
        return Err("a line of the head ends in LF without CR");
    }
    if head
        .iter()
        .any(|&b| (b < b' ' && !matches!(b, b'\r' | b'\n' | b'\t')) || b == 0x7f)
    {
        return Err("a control byte in the head");
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        // Malformed, another version (h2's preface): hyper answers or ends it.
        _ => return Ok(State::Head),
    }
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut upgrade = req.method == Some("CONNECT");
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            // The proxy's own reading: one length, or a list of the same one.
            let n = ebb_http::h1::content_lengths(h.value)
                .ok_or("a Content-Length that does not parse or disagrees with itself")?;
            if length.is_some_and(|l| l != n) {
                return Err("Content-Lengths that disagree");
            }
            length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if chunked || !h.value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err("a Transfer-Encoding other than one chunked");
            }
            chunked = true;
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    if chunked && length.is_some() {
        return Err("both Content-Length and Transfer-Encoding");
    }
    Ok(if upgrade {
        // A body of its own cannot be told from the upgraded protocol's bytes.
        State::Through
    } else if chunked {
        State::Chunks(Chunked::new())
    } else {
        match length {
            Some(n) if n > 0 => State::Body(n),
            _ => State::Head,
        }
    })
}

impl<S> Strict<S> {
    /// Checks what is buffered: moves `ready` on, or refuses.
    fn check(&mut self) {
        while self.ready < self.buf.len() {
            let rest = &self.buf[self.ready..];
            match &mut self.state {
                State::Refused(_) => return,
                State::Through => self.ready = self.buf.len(),
                State::Body(n) => {
                    let take = usize::try_from(*n).unwrap_or(usize::MAX).min(rest.len());
                    *n -= take as u64;
                    self.ready += take;
                    if *n == 0 {
                        self.state = State::Head;
                    }
                }
                State::Chunks(c) => match c.advance(rest) {
                    Ok(k) => {
                        self.ready += k;
                        if c.is_done() {
                            self.state = State::Head;
                        }
                    }
                    Err(_) => self.state = State::Refused("a malformed chunked body"),
                },
                State::Head => {
                    // Blank lines before a head are hyper's to skip.
                    let Some(end) = rest
                        .windows(2)
                        .position(|w| w == b"\n\n")
                        .map(|i| i + 2)
                        .or_else(|| {
                            rest.windows(4)
                                .position(|w| w == b"\r\n\r\n")
                                .map(|i| i + 4)
                        })
                    else {
                        if rest.len() > MAX_HEAD {
                            self.state = State::Refused("a head too long");
                        }
                        return;
                    };
                    // The earliest end: a head with a lone LF is refused whichever comes first.
                    let crlf = rest
                        .windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .map(|i| i + 4);
                    let end = crlf.map_or(end, |c| c.min(end));
                    match check_head(&rest[..end]) {
                        Ok(next) => {
                            self.ready += end;
                            self.state = next;
                        }
                        Err(why) => self.state = State::Refused(why),
                    }
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Strict<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        dst: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.ready > 0 {
                let n = this.ready.min(dst.remaining());
                dst.put_slice(&this.buf[..n]);
                this.buf.advance(n);
                this.ready -= n;
                return Poll::Ready(Ok(()));
            }
            if let State::Refused(why) = this.state {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, why)));
            }
            let mut chunk = [0u8; 8 * 1024];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // The end: what was not checked is not handed on.
                Poll::Ready(Ok(())) if read.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => this.buf.extend_from_slice(read.filled()),
            }
            this.check();
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Strict<S> {
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
}

/// ebb's endpoints' plain listener: each connection checked, without Nagle's delay.
pub struct StrictListener(pub tokio::net::TcpListener);

impl axum::serve::Listener for StrictListener {
    type Io = Strict<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return (Strict::new(stream), peer);
                }
                Err(e) => {
                    // Out of file descriptors, most likely: a moment's pause rather than a spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn through(input: &[u8]) -> io::Result<Vec<u8>> {
        let mut s = Strict::new(input);
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.map(|_| out)
    }

    #[tokio::test]
    async fn good_requests_pass_unchanged_and_bad_heads_end_the_connection() {
        let good = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhe\nloGET /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nGET /c HTTP/1.1\r\n\r\n";
        assert_eq!(through(good).await.unwrap(), good.to_vec());
        for bad in [
            &b"GET / HTTP/1.1\nHost: x\n\n"[..],
            b"GET / HTTP/1.1\r\nHost: x\r\nX: a\0b\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\n0\n\n",
            // The second request of the connection is checked too.
            b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.1\nHost: x\n\n",
        ] {
            let e = through(bad).await.unwrap_err();
            assert_eq!(
                e.kind(),
                io::ErrorKind::InvalidData,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
