//! What both HTTP/2 drivers ([`super::h2serve`], clients' connections; [`super::h2hop`], the
//! connections to replicas) keep of a body on its way out: its parts waiting for the peer's
//! windows, each carrying the credit it took from its stream's budget, written by one loop for
//! either side, and the socket writes of both.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use ebb_http::h2client::Client;
use ebb_http::h2server::{Server, StreamGone};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};

/// Credit taken from a stream's budget: returned once its bytes are written (or dropped).
pub(super) type Credit = (Arc<Semaphore>, u32);

/// Body bytes waiting for a window.
pub(super) enum Waiting {
    Data {
        data: Bytes,
        end: bool,
        credit: Option<Credit>,
    },
    Trailers(HeaderMap),
}

/// Returns the credit of body data that will not be written.
pub(super) fn release(waiting: VecDeque<Waiting>) {
    for w in waiting {
        if let Waiting::Data {
            credit: Some((budget, n)),
            ..
        } = w
        {
            budget.add_permits(n as usize);
        }
    }
}

/// A side of a connection that writes bodies: the server side answers', the client side
/// requests'.
pub(super) trait Sending {
    fn send_data(&mut self, stream: u32, data: &[u8], end: bool) -> Result<usize, StreamGone>;
    fn send_trailers(&mut self, stream: u32, fields: &HeaderMap) -> Result<(), StreamGone>;
}

fn fields(map: &HeaderMap) -> impl Iterator<Item = (&[u8], &[u8])> {
    map.iter()
        .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
}

impl Sending for Server {
    fn send_data(&mut self, stream: u32, data: &[u8], end: bool) -> Result<usize, StreamGone> {
        Server::send_data(self, stream, data, end)
    }

    fn send_trailers(&mut self, stream: u32, map: &HeaderMap) -> Result<(), StreamGone> {
        self.trailers(stream, fields(map))
    }
}

impl Sending for Client {
    fn send_data(&mut self, stream: u32, data: &[u8], end: bool) -> Result<usize, StreamGone> {
        Client::send_data(self, stream, data, end)
    }

    fn send_trailers(&mut self, stream: u32, map: &HeaderMap) -> Result<(), StreamGone> {
        self.trailers(stream, fields(map))
    }
}

/// Where [`flush`] left a body.
pub(super) enum Flushed {
    /// What is left (if anything) waits for a window.
    Waiting,
    /// Its end went out.
    Ended,
    /// Its stream is gone (reset, or ended): nothing more goes on it. What waited is still in
    /// the queue, for the caller to [`release`].
    Gone,
}

/// Writes what of `stream`'s waiting body the windows let go, returning each part's credit as
/// it goes out.
pub(super) fn flush(
    side: &mut impl Sending,
    stream: u32,
    waiting: &mut VecDeque<Waiting>,
) -> Flushed {
    loop {
        let Some(w) = waiting.front_mut() else {
            return Flushed::Waiting;
        };
        match w {
            Waiting::Data { data, end, credit } => {
                let Ok(n) = side.send_data(stream, data, *end) else {
                    return Flushed::Gone;
                };
                if n < data.len() {
                    data.advance(n);
                    return Flushed::Waiting;
                }
                if let Some((budget, n)) = credit.take() {
                    budget.add_permits(n as usize);
                }
                let end = *end;
                waiting.pop_front();
                if end {
                    return Flushed::Ended;
                }
            }
            Waiting::Trailers(map) => {
                let sent = side.send_trailers(stream, map);
                waiting.pop_front();
                return match sent {
                    Ok(()) => Flushed::Ended,
                    Err(_) => Flushed::Gone,
                };
            }
        }
    }
}

/// Fields as a header map (those that make no header are left out; the HTTP/2 side checked
/// them already).
pub(super) fn header_map(fields: Vec<(Vec<u8>, Vec<u8>)>) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(fields.len());
    for (name, value) in fields {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(&name),
            HeaderValue::from_maybe_shared(Bytes::from(value)),
        ) {
            map.append(n, v);
        }
    }
    map
}

/// Writes what a side made (its `out`) to the socket, and empties it.
pub(super) async fn write_out(sock: &mut TcpStream, out: &mut Vec<u8>) -> std::io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let written = sock.write_all(out).await;
    out.clear();
    written
}

/// Closes a body's channel and returns how many bytes of data (`len`) it held unread, so their
/// window goes back.
pub(super) fn unread<T>(rx: &mut mpsc::UnboundedReceiver<T>, len: impl Fn(&T) -> usize) -> usize {
    rx.close();
    let mut n = 0;
    while let Ok(part) = rx.try_recv() {
        n += len(&part);
    }
    n
}
