//! The HTTP/1 framing rules of the proxy's own parser, in front of hyper on ebb's endpoints. hyper
//! takes a lone LF as a line's end and decides framing by itself; this reader sees every request
//! head before hyper does and ends the connection at one that is ambiguous: a line ending in LF
//! alone, a NUL or other control byte, both Content-Length and Transfer-Encoding, Content-Lengths
//! that disagree or do not parse, a Transfer-Encoding other than `chunked`, obsolete line folding.
//! It follows each body (by its Content-Length or its chunks) to find the next head, and passes
//! every byte on unchanged.
//!
//! It sits under hyper on every connection of the admin address (`ebb::strict::StrictListener`
//! for plain TCP, and inside `ebb::tls::TlsListener` after the handshake), and, with the proxy's
//! rules ([`Strict::for_proxy`]), on every connection the proxy serves with hyper (over TLS, and
//! the connections its HTTP/1.1 path hands over): there only a head with a lone LF is refused,
//! as the HTTP/1.1 path refuses it, with the same 400. hyper reads, in its place, a request of
//! this reader's own that closes the connection ([`is_refusal`]: it carries a secret of this
//! process no client can send), so the 400 comes in its turn after the answers before it.
//! Everything else is hyper's to answer, as it is on that path.
//!
//! An HTTP/2 preface (h2c with prior knowledge) passes everything after it unchecked.
//!
//! With a deadline ([`Strict::first_within`], the header-read timeout), a connection that has
//! not sent a whole first head, or the HTTP/2 preface and the first frame's header, by then is
//! ended: hyper bounds the later heads of HTTP/1 itself, not HTTP/2's first frames, nor (on the
//! admin address, served by axum) any head.
//! The framing itself is `ebb_http`'s.

use std::future::Future;
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

/// Whose rules a connection is read by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rules {
    /// ebb's endpoints: every ambiguous head ends the connection.
    Endpoint,
    /// The proxy's general path: a lone LF is answered 400 and ends the connection; hyper
    /// decides the rest.
    Proxy,
}

/// The HTTP/2 connection preface's first line.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// A connection's reading side, checked head by head.
pub struct Strict<S> {
    inner: S,
    state: State,
    /// Bytes read from `inner`; the first `ready` are checked and may be handed on.
    buf: BytesMut,
    ready: usize,
    rules: Rules,
    /// Until the first head (or the preface and a frame header): the connection ends at it.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes read from `inner` so far.
    total: u64,
}

impl<S> Strict<S> {
    /// Checks what is read from `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            state: State::Head,
            buf: BytesMut::with_capacity(8 * 1024),
            ready: 0,
            rules: Rules::Endpoint,
            deadline: None,
            total: 0,
        }
    }

    /// Ends the connection if its first head (or its HTTP/2 preface and first frame header) is
    /// not read within `limit`.
    pub fn first_within(mut self, limit: std::time::Duration) -> Self {
        self.deadline = Some(Box::pin(tokio::time::sleep(limit)));
        self
    }

    /// Checks what is read from `inner` by the proxy's rules: a head with a line ending in LF
    /// alone is answered `400 bad_request` (as the HTTP/1.1 path answers it) and the connection
    /// ends; hyper answers every other malformed head itself.
    pub fn for_proxy(inner: S) -> Self {
        Self {
            rules: Rules::Proxy,
            ..Self::new(inner)
        }
    }
}

/// What a complete head says of the connection after it, or why it is refused.
fn check_head(head: &[u8], rules: Rules) -> Result<State, &'static str> {
    if head.starts_with(H2_PREFACE) {
        // h2c with prior knowledge: frames, not heads, from here on.
        return Ok(State::Through);
    }
    if ebb_http::h1::bare_lf(head) {
        return Err("a line of the head ends in LF without CR");
    }
    if rules == Rules::Proxy {
        return Ok(proxy_framing(head));
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

/// Where the next head is, by hyper's reading of a head it accepts (the proxy passes codings
/// ending in `chunked` on). A head hyper will refuse passes as it is, and what follows it too.
fn proxy_framing(head: &[u8]) -> State {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        // Blank lines only: hyper skips them.
        Ok(httparse::Status::Partial) => return State::Head,
        // hyper refuses it and closes.
        Err(_) => return State::Through,
    }
    let mut length: Option<u64> = None;
    let mut transfer = false;
    let mut chunked = false;
    let mut upgrade = req.method == Some("CONNECT");
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            match ebb_http::h1::content_lengths(h.value) {
                Some(n) if length.is_none_or(|l| l == n) => length = Some(n),
                _ => return State::Through,
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            transfer = true;
            chunked = ebb_http::h1::last_coding_is_chunked(h.value);
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    if upgrade || (transfer && !chunked) {
        State::Through
    } else if transfer {
        State::Chunks(Chunked::new())
    } else {
        match length {
            Some(n) if n > 0 => State::Body(n),
            _ => State::Head,
        }
    }
}

/// Where the head at the start of `data` ends: after the first line ending (CRLF or LF) that
/// is followed by an empty line.
fn head_end(data: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(p) = data[i..].iter().position(|&b| b == b'\n') {
        let lf = i + p;
        match &data[lf + 1..] {
            [b'\n', ..] => return Some(lf + 2),
            [b'\r', b'\n', ..] => return Some(lf + 3),
            _ => i = lf + 1,
        }
    }
    None
}

impl<S> Strict<S> {
    /// Checks what is buffered: moves `ready` on, or refuses.
    fn check(&mut self) {
        while self.ready < self.buf.len() {
            let rest = &self.buf[self.ready..];
            match &mut self.state {
                State::Refused(_) => return,
                State::Through => {
                    // HTTP/2: the preface (24 bytes) and a frame's header (9) are in.
                    if self.deadline.is_some() && self.total >= 33 {
                        self.deadline = None;
                    }
                    self.ready = self.buf.len();
                }
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
                    Err(_) if self.rules == Rules::Proxy => self.state = State::Through,
                    Err(_) => self.state = State::Refused("a malformed chunked body"),
                },
                State::Head => {
                    // Blank lines before a head are hyper's to skip. The head ends at the
                    // first empty line, its line ends CRLF or a lone LF (which is refused).
                    let Some(end) = head_end(rest) else {
                        if rest.starts_with(H2_PREFACE) {
                            self.state = State::Through;
                        } else if rest.len() > MAX_HEAD {
                            self.state = match self.rules {
                                // hyper's own bound answers it.
                                Rules::Proxy => State::Through,
                                Rules::Endpoint => State::Refused("a head too long"),
                            };
                        }
                        return;
                    };
                    match check_head(&rest[..end], self.rules) {
                        Ok(next) => {
                            if !matches!(next, State::Through) || !rest.starts_with(H2_PREFACE) {
                                self.deadline = None;
                            }
                            self.ready += end;
                            self.state = next;
                        }
                        Err(why) => {
                            self.state = State::Refused(why);
                            if self.rules == Rules::Proxy {
                                // hyper reads the refusal's request instead, and nothing after.
                                self.buf.truncate(self.ready);
                                self.buf.extend_from_slice(refusal_request().as_bytes());
                                self.ready = self.buf.len();
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The header of the request hyper reads in place of a refused head.
const REFUSED: &str = "x-ebb-refused-head";

/// This process's secret, in the refusal's request.
fn secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        // Keys drawn from the OS's randomness once per process.
        let word = |n: u64| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(n);
            h.finish()
        };
        format!("{:016x}{:016x}", word(1), word(2))
    })
}

/// The request hyper reads in place of a refused head.
fn refusal_request() -> String {
    format!(
        "GET / HTTP/1.1\r\n{REFUSED}: {}\r\nconnection: close\r\n\r\n",
        secret()
    )
}

/// Whether a request is one [`Strict::for_proxy`] put in place of a head it refused: the proxy
/// answers it `400 bad_request` and closes the connection.
pub fn is_refusal(headers: &hyper::HeaderMap) -> bool {
    headers
        .get(REFUSED)
        .is_some_and(|v| v.as_bytes() == secret().as_bytes())
}

/// What the proxy says of a head refused for a lone LF, on either path.
pub use ebb_http::h1::LONE_LF;

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
            if matches!(this.state, State::Through)
                && this.buf.is_empty()
                && this.deadline.is_none()
            {
                // Past the HTTP/2 preface or an upgrade, with nothing held back: nothing is
                // checked any more, so the caller's buffer is read into directly.
                return Pin::new(&mut this.inner).poll_read(cx, dst);
            }
            if let State::Refused(why) = this.state {
                if this.rules == Rules::Proxy {
                    // hyper has the refusal's request, which closes the connection once
                    // answered: nothing more to read (an end here would cut the answers).
                    return Poll::Pending;
                }
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, why)));
            }
            let mut chunk = [0u8; 8 * 1024];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => {
                    if let Some(d) = this.deadline.as_mut()
                        && d.as_mut().poll(cx).is_ready()
                    {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "nothing valid within the header-read timeout",
                        )));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // The end: what was not checked is not handed on.
                Poll::Ready(Ok(())) if read.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => {
                    this.total += read.filled().len() as u64;
                    this.buf.extend_from_slice(read.filled());
                }
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

    async fn through_proxy(input: &[u8]) -> Vec<u8> {
        let mut s = Strict::for_proxy(input);
        let mut out = vec![0u8; 64 * 1024];
        let mut n = 0;
        // The proxy's reader never ends after a refusal (hyper closes): read what it has.
        while let Ok(Ok(k)) =
            tokio::time::timeout(std::time::Duration::from_millis(50), s.read(&mut out[n..])).await
        {
            if k == 0 {
                break;
            }
            n += k;
        }
        out.truncate(n);
        out
    }

    #[tokio::test]
    async fn the_proxy_refuses_only_a_lone_lf_and_hyper_reads_its_refusal_in_turn() {
        // Codings ending in chunked, HTTP/1.0, a leading blank line, h2c frames: passed on.
        let good = b"\r\nPOST /a HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\na\nc\r\n0\r\n\r\nGET /b HTTP/1.0\r\n\r\n";
        assert_eq!(through_proxy(good).await, good.to_vec());
        let h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\n\n\x00";
        assert_eq!(through_proxy(h2).await, h2.to_vec());
        // A lone LF in the second head: the first request, then the refusal's, then nothing.
        let first = b"GET /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi";
        let mut bad = first.to_vec();
        bad.extend_from_slice(b"GET /b HTTP/1.1\r\nHost: x\n\r\nGET /smuggled HTTP/1.1\r\n\r\n");
        let got = through_proxy(&bad).await;
        assert!(
            got.starts_with(first),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
        let rest = &got[first.len()..];
        let mut headers = [httparse::EMPTY_HEADER; 8];
        let mut req = httparse::Request::new(&mut headers);
        assert!(matches!(
            req.parse(rest),
            Ok(httparse::Status::Complete(n)) if n == rest.len()
        ));
        let mut map = hyper::HeaderMap::new();
        for h in req.headers.iter() {
            map.insert(
                hyper::header::HeaderName::from_bytes(h.name.as_bytes()).unwrap(),
                hyper::header::HeaderValue::from_bytes(h.value).unwrap(),
            );
        }
        assert!(is_refusal(&map));
        map.insert(REFUSED, hyper::header::HeaderValue::from_static("guess"));
        assert!(!is_refusal(&map), "a client cannot send it");
    }
}
