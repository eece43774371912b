//! The client side of an HTTP/2 connection (RFC 9113), with no IO: the proxy's side of its
//! connections to replicas that speak h2c (gRPC). Requests go in ([`Client::request`],
//! [`Client::send_data`], [`Client::trailers`]) and come out as bytes to write
//! ([`Client::out`]); bytes read from the server go in ([`Client::recv`]) and come out as
//! answers, their data and their ends. It keeps the streams' states, both sides' windows and
//! the server's settings, decodes field blocks with [`crate::hpack`] and encodes requests as
//! literals with static-table names, as the server side encodes answers.
//!
//! What it leaves to its caller: the socket, which stream carries which request, and time.

use std::collections::HashMap;
use std::ops::Range;

use crate::h2::{self, ErrorCode, Frame, H2Error, Reader as _, Settings, setting};
use crate::h2server::{StreamGone, check_field, content_length, encode_field};
use crate::hpack;

/// What this side says in its SETTINGS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// The window each answer's body starts with.
    pub initial_window_size: u32,
    /// The connection's receive window (raised from 65,535 at the start).
    pub connection_window: u32,
    /// The largest answer head or trailers taken (as SETTINGS_MAX_HEADER_LIST_SIZE counts);
    /// a larger one resets its stream.
    pub max_header_list_size: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            initial_window_size: 1 << 20,
            connection_window: 1 << 24,
            max_header_list_size: 64 * 1024,
        }
    }
}

/// An answer's head.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    /// The other fields, in order, names lowercase.
    pub fields: Vec<(Vec<u8>, Vec<u8>)>,
}

/// What [`Client::recv`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The answer's head on `stream` (informational ones are skipped); `end_stream`: no body.
    Response {
        stream: u32,
        head: ResponseHead,
        end_stream: bool,
    },
    /// Part of an answer's body, where it is in the bytes given to `recv`. Once handled,
    /// [`Client::consumed`] gives its window back.
    Data {
        stream: u32,
        data: Range<usize>,
        end_stream: bool,
    },
    /// Trailers ending an answer.
    Trailers {
        stream: u32,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// The server reset the stream, broke its rules on it (this side reset it), or left it
    /// untouched going away (`REFUSED_STREAM`: the request may be sent again).
    Reset { stream: u32, code: ErrorCode },
    /// The window of `stream` (every stream: 0) opened: data held back may go now.
    Writable { stream: u32 },
    /// The server is going away: no new requests; those up to `last_stream` may finish.
    GoAway { last_stream: u32, code: ErrorCode },
}

/// [`Client::request`] could not open a stream: the server's stream limit is reached, it is
/// going away, or the connection failed or ran out of stream ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no stream can be opened on this connection now")]
pub struct Refused;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the server's SETTINGS, which must come first.
    Preface,
    Open,
    Failed,
}

#[derive(Debug)]
struct Stream {
    /// The server ended its side.
    remote_ended: bool,
    /// The answer's (final) head arrived.
    responded: bool,
    local_ended: bool,
    /// A HEAD request: its answer has no body whatever its `content-length`.
    head_request: bool,
    /// Its windows both ways (this side's may go below 0 when the peer lowers its settings).
    windows: h2::Windows,
    body_left: Option<u64>,
}

impl Stream {
    fn receiving(&mut self) -> h2::Receiving<'_> {
        h2::Receiving {
            windows: &mut self.windows,
            remote_ended: &mut self.remote_ended,
            body_left: &mut self.body_left,
        }
    }
}

struct Continuing {
    stream: u32,
    end_stream: bool,
    block: Vec<u8>,
}

/// One connection's client side.
pub struct Client {
    config: Config,
    phase: Phase,
    peer: Settings,
    decoder: hpack::Decoder,
    streams: HashMap<u32, Stream>,
    /// The next stream id to open (odd).
    next_stream: u32,
    flow: h2::Flow,
    continuing: Option<Continuing>,
    /// The last stream the server said it takes, once it sent GOAWAY.
    going_away: Option<u32>,
    resets: h2::RecentResets,
    out: Vec<u8>,
}

impl Client {
    /// A connection whose preface (the magic, this side's SETTINGS and the connection window's
    /// raise) is already in [`Client::out`].
    pub fn new(config: Config) -> Self {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(h2::PREFACE);
        h2::write_settings(
            &mut out,
            &[
                (setting::ENABLE_PUSH, 0),
                (setting::INITIAL_WINDOW_SIZE, config.initial_window_size),
                (setting::MAX_HEADER_LIST_SIZE, config.max_header_list_size),
            ],
        );
        let flow = h2::Flow::new(
            config.initial_window_size,
            config.connection_window,
            &mut out,
        );
        Self {
            config,
            phase: Phase::Preface,
            peer: Settings::default(),
            decoder: hpack::Decoder::new(4_096),
            streams: HashMap::new(),
            next_stream: 1,
            flow,
            continuing: None,
            going_away: None,
            resets: h2::RecentResets::default(),
            out,
        }
    }

    /// The bytes to write to the server.
    pub fn out(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Whether the connection failed (a GOAWAY with the error is in [`Client::out`]).
    pub fn failed(&self) -> bool {
        self.phase == Phase::Failed
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// The server's limit on streams open at once: `None` until its SETTINGS came, then the
    /// limit it set (`u32::MAX` when it set none).
    pub fn stream_limit(&self) -> Option<u32> {
        (self.phase == Phase::Open).then(|| self.peer.max_concurrent_streams.unwrap_or(u32::MAX))
    }

    /// Whether either side said GOAWAY: no stream opens on the connection any more.
    pub fn going_away(&self) -> bool {
        self.going_away.is_some()
    }

    /// Whether [`Client::request`] would open a stream now.
    pub fn can_open(&self) -> bool {
        self.phase != Phase::Failed
            && self.going_away.is_none()
            && self.next_stream <= h2::MAX_WINDOW
            && self.streams.len() < self.peer.max_concurrent_streams.unwrap_or(u32::MAX) as usize
    }

    /// Opens a stream with a request's head: the pseudo-header fields, then `fields` (names
    /// lowercase, no connection-specific ones: the caller's to leave out). `end_stream`: it
    /// has no body.
    pub fn request<'f>(
        &mut self,
        method: &[u8],
        scheme: &[u8],
        authority: &[u8],
        path: &[u8],
        fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
        end_stream: bool,
    ) -> Result<u32, Refused> {
        if !self.can_open() {
            return Err(Refused);
        }
        let stream = self.next_stream;
        self.next_stream += 2;
        let mut block = Vec::with_capacity(128);
        match method {
            b"GET" => block.push(0x82),
            b"POST" => block.push(0x83),
            _ => encode_field(&mut block, b":method", method),
        }
        match scheme {
            b"http" => block.push(0x86),
            b"https" => block.push(0x87),
            _ => encode_field(&mut block, b":scheme", scheme),
        }
        if !authority.is_empty() {
            encode_field(&mut block, b":authority", authority);
        }
        match path {
            b"/" => block.push(0x84),
            _ => encode_field(&mut block, b":path", path),
        }
        for (name, value) in fields {
            encode_field(&mut block, name, value);
        }
        h2::write_headers(
            &mut self.out,
            stream,
            &block,
            end_stream,
            self.peer.max_frame_size,
        );
        self.streams.insert(
            stream,
            Stream {
                remote_ended: false,
                responded: false,
                local_ended: end_stream,
                head_request: method == b"HEAD",
                windows: self.flow.stream(self.peer.initial_window_size),
                body_left: None,
            },
        );
        Ok(stream)
    }

    /// Writes as much of `data` on `stream` as the windows allow and returns how much; the
    /// stream's side ends with the last byte when `end_stream` and all of it went. The rest
    /// waits for an [`Event::Writable`].
    pub fn send_data(
        &mut self,
        stream: u32,
        data: &[u8],
        end_stream: bool,
    ) -> Result<usize, StreamGone> {
        let s = match self.streams.get_mut(&stream) {
            Some(s) if !s.local_ended => s,
            _ => return Err(StreamGone(stream)),
        };
        let n = data.len().min(self.flow.room(&s.windows));
        let ends = end_stream && n == data.len();
        if n == 0 && !ends {
            return Ok(0);
        }
        h2::write_data(
            &mut self.out,
            stream,
            &data[..n],
            ends,
            self.peer.max_frame_size,
        );
        self.flow.sent(&mut s.windows, n);
        if ends {
            s.local_ended = true;
            self.close_if_done(stream);
        }
        Ok(n)
    }

    /// Writes trailers ending the request on `stream`.
    pub fn trailers<'f>(
        &mut self,
        stream: u32,
        fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
    ) -> Result<(), StreamGone> {
        let s = match self.streams.get_mut(&stream) {
            Some(s) if !s.local_ended => s,
            _ => return Err(StreamGone(stream)),
        };
        let mut block = Vec::with_capacity(64);
        for (name, value) in fields {
            encode_field(&mut block, name, value);
        }
        s.local_ended = true;
        h2::write_headers(
            &mut self.out,
            stream,
            &block,
            true,
            self.peer.max_frame_size,
        );
        self.close_if_done(stream);
        Ok(())
    }

    /// Gives back `n` bytes of an answer's body the caller handled.
    pub fn consumed(&mut self, stream: u32, n: usize) {
        self.give_back(stream, n);
    }

    /// Resets `stream` (this side gives up on it: its client left, a bound passed).
    pub fn reset(&mut self, stream: u32, code: ErrorCode) {
        if self.streams.remove(&stream).is_some() {
            h2::write_rst_stream(&mut self.out, stream, code);
            self.resets.remember(stream);
        }
    }

    /// Says this side opens no more streams (a graceful end).
    pub fn go_away(&mut self) {
        if self.phase != Phase::Failed {
            h2::write_goaway(&mut self.out, 0, ErrorCode::NO_ERROR, b"");
            self.going_away.get_or_insert(u32::MAX);
        }
    }

    /// Reads whole frames from `buf`, pushing what they say to `events`, and returns how many
    /// bytes it took. A connection error writes its GOAWAY, marks the connection failed and
    /// is returned.
    pub fn recv(&mut self, buf: &[u8], events: &mut Vec<Event>) -> Result<usize, H2Error> {
        if self.phase == Phase::Failed {
            return Ok(buf.len());
        }
        if self.phase == Phase::Preface {
            match h2::Head::read(buf) {
                None => return Ok(0),
                Some(head)
                    if head.kind != h2::kind::SETTINGS || head.flags & h2::flag::ACK != 0 =>
                {
                    return Err(self.fail(H2Error::Connection(
                        ErrorCode::PROTOCOL_ERROR,
                        "the server's preface is not a SETTINGS frame",
                    )));
                }
                Some(_) => self.phase = Phase::Open,
            }
        }
        h2::read_frames(self, buf, 0, events)
    }

    /// A frame on a stream this side never opened (an even one: push is off) is a
    /// connection error.
    fn known(&self, stream: u32) -> Result<(), H2Error> {
        if stream >= self.next_stream || stream.is_multiple_of(2) {
            return Err(H2Error::Connection(
                ErrorCode::PROTOCOL_ERROR,
                "a frame on a stream this side did not open",
            ));
        }
        Ok(())
    }

    fn check_block_size(&self) -> Result<(), H2Error> {
        let len = self.continuing.as_ref().map_or(0, |c| c.block.len());
        h2::check_block_size(len, self.config.max_header_list_size)
    }

    fn field_block(
        &mut self,
        stream: u32,
        end_stream: bool,
        block: &[u8],
        events: &mut Vec<Event>,
    ) -> Result<(), H2Error> {
        // Decoded first, whatever happens to the stream: the table must follow every block.
        let fields = self.decode(block)?;
        self.known(stream)?;
        let malformed = |why| H2Error::Stream(stream, ErrorCode::PROTOCOL_ERROR, why);
        let Some(s) = self.streams.get_mut(&stream) else {
            if self.resets.contains(stream) {
                return Ok(());
            }
            return Err(H2Error::Connection(
                ErrorCode::STREAM_CLOSED,
                "HEADERS on a closed stream",
            ));
        };
        if s.remote_ended {
            return Err(H2Error::Stream(
                stream,
                ErrorCode::STREAM_CLOSED,
                "HEADERS after the answer's end",
            ));
        }
        let Some(mut fields) = fields else {
            return Err(malformed("a field block past the header list's size"));
        };
        if s.responded {
            // Trailers.
            if !end_stream {
                return Err(malformed("trailers without END_STREAM"));
            }
            if fields.iter().any(|(n, _)| n.starts_with(b":")) {
                return Err(malformed("a pseudo-header field in trailers"));
            }
            if let Some(why) = fields.iter().find_map(|(n, v)| check_field(n, v).err()) {
                return Err(malformed(why));
            }
            if s.body_left.is_some_and(|n| n > 0) {
                return Err(malformed("a body shorter than its content-length"));
            }
            s.remote_ended = true;
            events.push(Event::Trailers { stream, fields });
            self.close_if_done(stream);
            return Ok(());
        }
        let status = match fields.first() {
            Some((name, value)) if name == b":status" => std::str::from_utf8(value)
                .ok()
                .filter(|v| v.len() == 3 && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u16>().ok())
                .filter(|&v| v >= 100)
                .ok_or_else(|| malformed("a :status that is not three digits"))?,
            _ => return Err(malformed("an answer without :status first")),
        };
        fields.remove(0);
        if fields.iter().any(|(n, _)| n.starts_with(b":")) {
            return Err(malformed("a pseudo-header field other than :status"));
        }
        if let Some(why) = fields.iter().find_map(|(n, v)| check_field(n, v).err()) {
            return Err(malformed(why));
        }
        if (100..200).contains(&status) {
            // Informational: skipped, the final head is still to come (101 has no place in
            // HTTP/2).
            if end_stream || status == 101 {
                return Err(malformed("an informational answer that ends the stream"));
            }
            return Ok(());
        }
        let length = content_length(&fields).map_err(malformed)?;
        let bodiless = s.head_request || status == 204 || status == 304;
        s.body_left = if bodiless { None } else { length };
        if end_stream && s.body_left.is_some_and(|n| n > 0) {
            return Err(malformed("a content-length and no body"));
        }
        s.responded = true;
        s.remote_ended = end_stream;
        events.push(Event::Response {
            stream,
            head: ResponseHead { status, fields },
            end_stream,
        });
        self.close_if_done(stream);
        Ok(())
    }

    /// The block's fields, or `None` when they pass the header list's size; a block that does
    /// not decode is a connection error.
    #[allow(clippy::type_complexity)]
    fn decode(&mut self, block: &[u8]) -> Result<Option<Vec<(Vec<u8>, Vec<u8>)>>, H2Error> {
        self.decoder
            .decode_fields(block, self.config.max_header_list_size)
            .map_err(|_| {
                H2Error::Connection(
                    ErrorCode::COMPRESSION_ERROR,
                    "a field block that does not decode",
                )
            })
    }

    fn close_if_done(&mut self, stream: u32) {
        if let Some(s) = self.streams.get(&stream)
            && s.remote_ended
            && s.local_ended
        {
            self.streams.remove(&stream);
        }
    }

    /// `n` bytes of `stream` (0: of no stream) handled or dropped: WINDOW_UPDATEs once half a
    /// window waits to be given back.
    fn give_back(&mut self, stream: u32, n: usize) {
        let windows = self
            .streams
            .get_mut(&stream)
            .map(|s| (&mut s.windows, s.remote_ended));
        self.flow.give_back(&mut self.out, stream, windows, n);
    }
}

impl h2::Reader for Client {
    type Event = Event;

    fn continuing(&self) -> bool {
        self.continuing.is_some()
    }

    fn frame(
        &mut self,
        frame: Frame<'_>,
        buf: &[u8],
        payload_at: usize,
        events: &mut Vec<Event>,
    ) -> Result<(), H2Error> {
        let conn = H2Error::Connection;
        if let Some(c) = &self.continuing {
            match frame {
                Frame::Continuation { stream, .. } if stream == c.stream => {}
                _ => {
                    return Err(conn(
                        ErrorCode::PROTOCOL_ERROR,
                        "a field block cut by another frame",
                    ));
                }
            }
        }
        match frame {
            Frame::Settings { ack: true, .. } => {}
            Frame::Settings {
                ack: false,
                entries,
            } => {
                let grew = h2::take_settings(
                    &mut self.peer,
                    entries,
                    self.streams.values_mut().map(|s| &mut s.windows),
                    &mut self.out,
                )?;
                if grew {
                    for (&stream, s) in &self.streams {
                        if s.windows.open() && !s.local_ended {
                            events.push(Event::Writable { stream });
                        }
                    }
                }
            }
            Frame::Ping {
                ack: false,
                payload,
            } => h2::write_ping(&mut self.out, true, payload),
            Frame::Ping { ack: true, .. } => {}
            Frame::GoAway {
                last_stream, code, ..
            } => {
                self.going_away = Some(last_stream);
                // The streams past `last_stream` were never taken: the caller may send them
                // again elsewhere.
                let mut refused: Vec<u32> = self
                    .streams
                    .keys()
                    .copied()
                    .filter(|&s| s > last_stream)
                    .collect();
                refused.sort_unstable();
                for stream in refused {
                    self.streams.remove(&stream);
                    events.push(Event::Reset {
                        stream,
                        code: ErrorCode::REFUSED_STREAM,
                    });
                }
                events.push(Event::GoAway { last_stream, code });
            }
            Frame::WindowUpdate {
                stream: 0,
                increment,
            } => {
                self.flow.connection_update(increment)?;
                events.push(Event::Writable { stream: 0 });
            }
            Frame::WindowUpdate { stream, increment } => {
                self.known(stream)?;
                if let Some(s) = self.streams.get_mut(&stream) {
                    h2::Flow::stream_update(&mut s.windows, stream, increment)?;
                    events.push(Event::Writable { stream });
                }
            }
            Frame::RstStream { stream, code } => {
                self.known(stream)?;
                if self.streams.remove(&stream).is_some() {
                    events.push(Event::Reset { stream, code });
                }
            }
            Frame::Priority { .. } | Frame::Unknown { .. } => {}
            Frame::PushPromise { .. } => {
                return Err(conn(
                    ErrorCode::PROTOCOL_ERROR,
                    "PUSH_PROMISE though SETTINGS_ENABLE_PUSH is 0",
                ));
            }
            Frame::Data {
                stream,
                end_stream,
                data,
                flow_len,
            } => {
                self.known(stream)?;
                self.flow.received(flow_len)?;
                let receiving = match self.streams.get_mut(&stream) {
                    None if self.resets.contains(stream) => {
                        self.give_back(0, flow_len as usize);
                        return Ok(());
                    }
                    Some(s) if !s.remote_ended && !s.responded => Err(H2Error::Stream(
                        stream,
                        ErrorCode::PROTOCOL_ERROR,
                        "DATA before the answer's head",
                    )),
                    s => h2::open_for_data(
                        stream,
                        s.map(Stream::receiving),
                        "DATA after the answer's end",
                    ),
                };
                self.flow.take_data(
                    &mut self.out,
                    stream,
                    receiving,
                    flow_len,
                    data.len(),
                    end_stream,
                )?;
                events.push(Event::Data {
                    stream,
                    data: h2::range_in(buf, payload_at, data),
                    end_stream,
                });
                self.close_if_done(stream);
            }
            Frame::Headers {
                stream,
                end_stream,
                end_headers,
                block,
                ..
            } => {
                if end_headers {
                    self.field_block(stream, end_stream, block, events)?;
                } else {
                    self.continuing = Some(Continuing {
                        stream,
                        end_stream,
                        block: block.to_vec(),
                    });
                    self.check_block_size()?;
                }
            }
            Frame::Continuation {
                end_headers, block, ..
            } => {
                let Some(c) = &mut self.continuing else {
                    return Err(conn(
                        ErrorCode::PROTOCOL_ERROR,
                        "a CONTINUATION without its HEADERS",
                    ));
                };
                c.block.extend_from_slice(block);
                self.check_block_size()?;
                if end_headers {
                    let c = self.continuing.take().expect("continuing");
                    self.field_block(c.stream, c.end_stream, &c.block, events)?;
                }
            }
        }
        Ok(())
    }

    /// Resets the stream of a stream error (telling the caller), or fails the connection.
    fn stream_error(&mut self, e: H2Error, events: &mut Vec<Event>) -> Result<(), H2Error> {
        match e {
            H2Error::Stream(stream, code, _) => {
                h2::write_rst_stream(&mut self.out, stream, code);
                if self.streams.remove(&stream).is_some() {
                    events.push(Event::Reset { stream, code });
                }
                self.resets.remember(stream);
                Ok(())
            }
            H2Error::Connection(..) => Err(self.fail(e)),
        }
    }

    fn fail(&mut self, e: H2Error) -> H2Error {
        if self.phase != Phase::Failed {
            let why = e.to_string();
            h2::write_goaway(&mut self.out, 0, e.code(), why.as_bytes());
            self.phase = Phase::Failed;
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::h2::{kind, write_head};

    /// The server's bytes: an empty SETTINGS, then `frames`.
    fn server(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        h2::write_settings(&mut out, &[]);
        for f in frames {
            out.extend_from_slice(f);
        }
        out
    }

    fn headers(stream: u32, fields: &[(&[u8], &[u8])], end_stream: bool) -> Vec<u8> {
        let mut block = Vec::new();
        for (n, v) in fields {
            encode_field(&mut block, n, v);
        }
        let mut out = Vec::new();
        h2::write_headers(&mut out, stream, &block, end_stream, 16_384);
        out
    }

    fn data(stream: u32, bytes: &[u8], end_stream: bool) -> Vec<u8> {
        let mut out = Vec::new();
        h2::write_data_head(&mut out, stream, bytes.len(), end_stream);
        out.extend_from_slice(bytes);
        out
    }

    fn get(c: &mut Client) -> u32 {
        c.request(b"GET", b"http", b"app", b"/", [], true).unwrap()
    }

    fn recv_all(c: &mut Client, bytes: &[u8]) -> Result<Vec<Event>, H2Error> {
        let mut events = Vec::new();
        let used = c.recv(bytes, &mut events)?;
        assert_eq!(used, bytes.len());
        Ok(events)
    }

    #[test]
    fn an_answer_its_body_and_trailers_arrive_in_order() {
        let mut c = Client::new(Config::default());
        assert!(c.out().starts_with(h2::PREFACE));
        let s = get(&mut c);
        assert_eq!(s, 1);
        let (continue_, head) = (
            headers(1, &[(b":status", b"100")], false),
            headers(1, &[(b":status", b"200"), (b"content-length", b"2")], false),
        );
        let bytes = server(&[
            continue_.clone(),
            head.clone(),
            data(1, b"hi", false),
            headers(1, &[(b"grpc-status", b"0")], true),
        ]);
        let events = recv_all(&mut c, &bytes).unwrap();
        // After SETTINGS, the two heads and the DATA frame's own head.
        let at = 9 + continue_.len() + head.len() + 9;
        assert_eq!(
            events,
            [
                Event::Response {
                    stream: 1,
                    head: ResponseHead {
                        status: 200,
                        fields: vec![(b"content-length".to_vec(), b"2".to_vec())]
                    },
                    end_stream: false
                },
                Event::Data {
                    stream: 1,
                    data: at..at + 2,
                    end_stream: false
                },
                Event::Trailers {
                    stream: 1,
                    fields: vec![(b"grpc-status".to_vec(), b"0".to_vec())]
                },
            ]
        );
        assert_eq!(&bytes[at..at + 2], b"hi");
        assert_eq!(c.open_streams(), 0, "both sides ended");
    }

    #[test]
    fn the_server_must_begin_with_settings() {
        let mut c = Client::new(Config::default());
        get(&mut c);
        let mut events = Vec::new();
        let e = c.recv(&headers(1, &[(b":status", b"200")], true), &mut events);
        assert!(matches!(
            e,
            Err(H2Error::Connection(ErrorCode::PROTOCOL_ERROR, _))
        ));
        assert!(c.failed());
        assert!(!c.can_open());
    }

    #[test]
    fn a_goaway_refuses_the_streams_past_its_last() {
        let mut c = Client::new(Config::default());
        let ids: Vec<u32> = (0..3).map(|_| get(&mut c)).collect();
        assert_eq!(ids, [1, 3, 5]);
        let mut goaway = Vec::new();
        h2::write_goaway(&mut goaway, 1, ErrorCode::NO_ERROR, b"");
        let events = recv_all(&mut c, &server(&[goaway])).unwrap();
        assert_eq!(
            events,
            [
                Event::Reset {
                    stream: 3,
                    code: ErrorCode::REFUSED_STREAM
                },
                Event::Reset {
                    stream: 5,
                    code: ErrorCode::REFUSED_STREAM
                },
                Event::GoAway {
                    last_stream: 1,
                    code: ErrorCode::NO_ERROR
                },
            ]
        );
        assert!(!c.can_open());
        assert_eq!(
            c.request(b"GET", b"http", b"app", b"/", [], true),
            Err(Refused)
        );
        // Stream 1 may still finish.
        let events = recv_all(&mut c, &headers(1, &[(b":status", b"204")], true)).unwrap();
        assert!(matches!(events[..], [Event::Response { stream: 1, .. }]));
    }

    #[test]
    fn the_servers_stream_limit_holds_new_requests_back() {
        let mut c = Client::new(Config::default());
        let mut settings = Vec::new();
        h2::write_settings(&mut settings, &[(setting::MAX_CONCURRENT_STREAMS, 1)]);
        recv_all(&mut c, &settings).unwrap();
        get(&mut c);
        assert!(!c.can_open());
        recv_all(&mut c, &headers(1, &[(b":status", b"200")], true)).unwrap();
        assert!(c.can_open(), "the answer closed the stream");
    }

    #[test]
    fn broken_answers_reset_their_stream_or_fail_the_connection() {
        let mut c = Client::new(Config::default());
        let a = get(&mut c);
        let b = get(&mut c);
        let events = recv_all(
            &mut c,
            &server(&[
                // DATA before the head.
                data(a, b"x", true),
                // A head without :status.
                headers(b, &[(b"content-type", b"text/plain")], true),
            ]),
        )
        .unwrap();
        assert_eq!(
            events,
            [
                Event::Reset {
                    stream: a,
                    code: ErrorCode::PROTOCOL_ERROR
                },
                Event::Reset {
                    stream: b,
                    code: ErrorCode::PROTOCOL_ERROR
                },
            ]
        );
        // Frames on them after the reset are ignored.
        recv_all(&mut c, &data(a, b"late", true)).unwrap();
        // PUSH_PROMISE, though push is off: the connection fails.
        let mut push = Vec::new();
        write_head(&mut push, 4, kind::PUSH_PROMISE, h2::flag::END_HEADERS, 1);
        push.extend_from_slice(&2u32.to_be_bytes());
        let mut events = Vec::new();
        assert!(matches!(
            c.recv(&push, &mut events),
            Err(H2Error::Connection(ErrorCode::PROTOCOL_ERROR, _))
        ));
    }

    #[test]
    fn a_request_body_waits_for_the_servers_windows() {
        let mut c = Client::new(Config::default());
        let s = c
            .request(b"POST", b"http", b"app", b"/up", [], false)
            .unwrap();
        let body = vec![7u8; 100_000];
        // 65,535 bytes: the default window, the connection's and the stream's.
        assert_eq!(c.send_data(s, &body, true), Ok(65_535));
        assert_eq!(c.send_data(s, &body[65_535..], true), Ok(0));
        let mut update = Vec::new();
        h2::write_window_update(&mut update, 0, 50_000);
        h2::write_window_update(&mut update, s, 50_000);
        let events = recv_all(&mut c, &server(&[update])).unwrap();
        assert_eq!(
            events,
            [Event::Writable { stream: 0 }, Event::Writable { stream: s }]
        );
        assert_eq!(c.send_data(s, &body[65_535..], true), Ok(34_465));
        assert_eq!(c.send_data(s, b"", true), Err(StreamGone(s)), "ended");
    }
}
