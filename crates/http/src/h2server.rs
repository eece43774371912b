//! The server side of an HTTP/2 connection (RFC 9113), with no IO: bytes read from the client go
//! in ([`Server::recv`]) and come out as requests, their data and their ends; answers go in
//! ([`Server::respond`], [`Server::send_data`]) and come out as bytes to write ([`Server::out`]).
//! It keeps the streams' states, both sides' flow-control windows and the settings, decodes
//! field blocks with HPACK ([`crate::hpack`]) and encodes answers without the dynamic
//! table (literals, names from the static table: nothing to keep in step with the client).
//!
//! What it leaves to its caller: reading and writing the socket, routing, the HTTP semantics
//! of a request beyond its pseudo-header fields, and time (a peer that never acknowledges
//! SETTINGS is the caller's to time out).

use std::collections::HashMap;
use std::ops::Range;

use crate::h2::{self, ErrorCode, Frame, H2Error, Reader as _, Settings, setting};
use crate::hpack;

/// What this side says in its SETTINGS, and holds the client to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Streams the client may have open at once; more are refused (REFUSED_STREAM).
    pub max_concurrent_streams: u32,
    /// The window each stream's request body starts with.
    pub initial_window_size: u32,
    /// The connection's receive window (raised from 65,535 at the start).
    pub connection_window: u32,
    /// The largest field block taken (its decoded fields, each name and value and 32 bytes,
    /// as SETTINGS_MAX_HEADER_LIST_SIZE counts them); a larger one is a stream error
    /// (PROTOCOL_ERROR: the request is reset, the connection goes on).
    pub max_header_list_size: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 256,
            initial_window_size: 1 << 20,
            connection_window: 1 << 24,
            max_header_list_size: 64 * 1024,
        }
    }
}

/// A request's head, as its field block said it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: Vec<u8>,
    pub scheme: Vec<u8>,
    pub authority: Vec<u8>,
    pub path: Vec<u8>,
    /// The other fields, in order, names lowercase.
    pub fields: Vec<(Vec<u8>, Vec<u8>)>,
}

/// What [`Server::recv`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A new request on `stream`; `end_stream`: it has no body.
    Request {
        stream: u32,
        head: RequestHead,
        end_stream: bool,
    },
    /// Part of a request's body: `data` is where it is in the bytes given to `recv`. Once
    /// handled, [`Server::consumed`] gives its window back.
    Data {
        stream: u32,
        data: Range<usize>,
        end_stream: bool,
    },
    /// Trailers ending a request's body.
    Trailers {
        stream: u32,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// The client reset the stream, or broke its rules (this side sent RST_STREAM): it is gone.
    Reset { stream: u32, code: ErrorCode },
    /// The window of `stream` (every stream: 0) opened: data held back may go now.
    Writable { stream: u32 },
    /// The client is going away: no new requests; the open ones may finish.
    GoAway { code: ErrorCode },
}

/// A stream [`Server::respond`] or [`Server::send_data`] cannot write on: reset or never open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stream {0} is not open for an answer")]
pub struct StreamGone(pub u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the client's preface and its SETTINGS.
    Preface,
    Open,
    /// A connection error was sent: nothing more is read.
    Failed,
}

#[derive(Debug)]
struct Stream {
    /// The client ended its side.
    remote_ended: bool,
    /// This side sent its answer's head.
    responded: bool,
    /// This side ended its side.
    local_ended: bool,
    /// Its windows both ways (this side's may go below 0 when the peer lowers its settings).
    windows: h2::Windows,
    /// What is left of the body its `content-length` said, if it said one.
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

/// A field block being read across CONTINUATION frames.
struct Continuing {
    stream: u32,
    end_stream: bool,
    /// The HEADERS said the stream depends on itself: a stream error once decoded.
    on_itself: bool,
    block: Vec<u8>,
}

/// One client connection's HTTP/2 state.
pub struct Server {
    config: Config,
    phase: Phase,
    peer: Settings,
    decoder: hpack::Decoder,
    streams: HashMap<u32, Stream>,
    /// The highest stream the client opened: lower ones not in `streams` are closed.
    last_stream: u32,
    flow: h2::Flow,
    continuing: Option<Continuing>,
    /// Whether a GOAWAY was sent (no new streams are taken after it).
    going_away: bool,
    /// The streams this side reset lately.
    resets: h2::RecentResets,
    /// Requests the client cancelled before their answer, and answers sent.
    early_resets: u64,
    answered: u64,
    out: Vec<u8>,
}

/// How many requests the client may cancel before their answers beyond the number answered,
/// before the connection is refused with ENHANCE_YOUR_CALM: opening and resetting streams
/// costs this side work the client does not wait for (the "rapid reset" attack).
const EARLY_RESETS_ALLOWED: u64 = 1_024;

impl Server {
    /// A connection whose server preface (this side's SETTINGS and the connection window's
    /// raise) is already in [`Server::out`].
    pub fn new(config: Config) -> Self {
        let mut out = Vec::with_capacity(64);
        h2::write_settings(
            &mut out,
            &[
                (setting::ENABLE_PUSH, 0),
                (
                    setting::MAX_CONCURRENT_STREAMS,
                    config.max_concurrent_streams,
                ),
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
            // A client may not take the table past the size this side allows (4,096 bytes, as
            // it does not say another).
            decoder: hpack::Decoder::new(4_096),
            streams: HashMap::new(),
            last_stream: 0,
            flow,
            continuing: None,
            going_away: false,
            resets: h2::RecentResets::default(),
            early_resets: 0,
            answered: 0,
            out,
        }
    }

    /// The bytes to write to the client; the caller takes them (`std::mem::take`, or writes
    /// and clears).
    pub fn out(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Whether the connection failed (a GOAWAY with the error is in [`Server::out`]): write
    /// it, then close.
    pub fn failed(&self) -> bool {
        self.phase == Phase::Failed
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// Reads whole frames from `buf`, pushing what they say to `events`, and returns how many
    /// bytes it took (the rest is an incomplete frame: give it again with more). A connection
    /// error writes its GOAWAY, marks the connection failed and is returned.
    pub fn recv(&mut self, buf: &[u8], events: &mut Vec<Event>) -> Result<usize, H2Error> {
        let mut at = 0;
        if self.phase == Phase::Failed {
            return Ok(buf.len());
        }
        if self.phase == Phase::Preface {
            let n = buf.len().min(h2::PREFACE.len());
            if buf[..n] != h2::PREFACE[..n] {
                return Err(self.fail(H2Error::Connection(
                    ErrorCode::PROTOCOL_ERROR,
                    "not the HTTP/2 connection preface",
                )));
            }
            if n < h2::PREFACE.len() {
                return Ok(0);
            }
            // Then a SETTINGS frame, first of all.
            match h2::Head::read(&buf[n..]) {
                None => return Ok(0),
                Some(head)
                    if head.kind != h2::kind::SETTINGS || head.flags & h2::flag::ACK != 0 =>
                {
                    return Err(self.fail(H2Error::Connection(
                        ErrorCode::PROTOCOL_ERROR,
                        "the preface not followed by SETTINGS",
                    )));
                }
                Some(_) => {}
            }
            at = n;
            self.phase = Phase::Open;
        }
        h2::read_frames(self, buf, at, events)
    }

    /// A field block's bytes are bounded before it is decoded: four times the decoded bound
    /// (HPACK's literals are at worst a little longer than their text).
    fn check_block_size(&self) -> Result<(), H2Error> {
        let len = self.continuing.as_ref().map_or(0, |c| c.block.len());
        h2::check_block_size(len, self.config.max_header_list_size)
    }

    /// A frame on a stream the client has not opened (idle) is a connection error.
    fn known(&self, stream: u32) -> Result<(), H2Error> {
        if stream > self.last_stream {
            return Err(H2Error::Connection(
                ErrorCode::PROTOCOL_ERROR,
                "a frame on a stream not opened",
            ));
        }
        Ok(())
    }

    fn field_block(
        &mut self,
        stream: u32,
        end_stream: bool,
        on_itself: bool,
        block: &[u8],
        events: &mut Vec<Event>,
    ) -> Result<(), H2Error> {
        // Decoded first, whatever happens to the stream: the decoder's table must follow
        // every block.
        let fields = self.decode(block)?;
        let malformed = |why| H2Error::Stream(stream, ErrorCode::PROTOCOL_ERROR, why);
        if on_itself {
            if stream > self.last_stream && !stream.is_multiple_of(2) {
                self.last_stream = stream;
            }
            return Err(malformed("a stream that depends on itself"));
        }
        if let Some(s) = self.streams.get_mut(&stream) {
            // Trailers: the end of the request's body.
            if s.remote_ended {
                return Err(H2Error::Stream(
                    stream,
                    ErrorCode::STREAM_CLOSED,
                    "HEADERS after the request's end",
                ));
            }
            if !end_stream {
                return Err(malformed("trailers without END_STREAM"));
            }
            let Some(fields) = fields else {
                return Err(malformed("trailers past the header list's size"));
            };
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
        if stream <= self.last_stream {
            if self.resets.contains(stream) {
                // Trailers sent before the client knew of this side's reset: ignored (the
                // block was decoded, so the table stays in step).
                return Ok(());
            }
            return Err(H2Error::Connection(
                ErrorCode::STREAM_CLOSED,
                "HEADERS on a closed stream",
            ));
        }
        if stream.is_multiple_of(2) {
            return Err(H2Error::Connection(
                ErrorCode::PROTOCOL_ERROR,
                "a client stream with an even number",
            ));
        }
        self.last_stream = stream;
        if self.going_away {
            return Err(H2Error::Stream(
                stream,
                ErrorCode::REFUSED_STREAM,
                "the connection is going away",
            ));
        }
        if self.streams.len() >= self.config.max_concurrent_streams as usize {
            return Err(H2Error::Stream(
                stream,
                ErrorCode::REFUSED_STREAM,
                "more streams than SETTINGS_MAX_CONCURRENT_STREAMS",
            ));
        }
        let Some(fields) = fields else {
            return Err(malformed("a request head past the header list's size"));
        };
        let head = request_head(fields).map_err(malformed)?;
        let content_length = content_length(&head.fields).map_err(malformed)?;
        if end_stream && content_length.is_some_and(|n| n > 0) {
            return Err(malformed("a content-length and no body"));
        }
        self.streams.insert(
            stream,
            Stream {
                remote_ended: end_stream,
                responded: false,
                local_ended: false,
                windows: self.flow.stream(self.peer.initial_window_size),
                body_left: content_length,
            },
        );
        events.push(Event::Request {
            stream,
            head,
            end_stream,
        });
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

    /// Gives back `n` bytes of a request's body the caller handled: WINDOW_UPDATEs once half
    /// a window is waiting to be given back (the stream's only while its body goes on).
    pub fn consumed(&mut self, stream: u32, n: usize) {
        self.give_back(stream, n);
    }

    /// `n` bytes of `stream` (0: of no stream) handled or dropped.
    fn give_back(&mut self, stream: u32, n: usize) {
        let windows = self
            .streams
            .get_mut(&stream)
            .map(|s| (&mut s.windows, s.remote_ended));
        self.flow.give_back(&mut self.out, stream, windows, n);
    }

    /// Writes an answer's head on `stream`: `:status`, then `fields` (names lowercase, no
    /// connection-specific ones: the caller's to leave out).
    pub fn respond<'f>(
        &mut self,
        stream: u32,
        status: u16,
        fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
        end_stream: bool,
    ) -> Result<(), StreamGone> {
        let s = match self.streams.get_mut(&stream) {
            Some(s) if !s.local_ended => s,
            _ => return Err(StreamGone(stream)),
        };
        let mut block = Vec::with_capacity(64);
        encode_status(&mut block, status);
        for (name, value) in fields {
            encode_field(&mut block, name, value);
        }
        s.responded = true;
        s.local_ended = end_stream;
        self.answered += 1;
        h2::write_headers(
            &mut self.out,
            stream,
            &block,
            end_stream,
            self.peer.max_frame_size,
        );
        self.close_if_done(stream);
        Ok(())
    }

    /// Writes trailers ending the answer on `stream`.
    pub fn trailers<'f>(
        &mut self,
        stream: u32,
        fields: impl IntoIterator<Item = (&'f [u8], &'f [u8])>,
    ) -> Result<(), StreamGone> {
        let s = match self.streams.get_mut(&stream) {
            Some(s) if s.responded && !s.local_ended => s,
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

    /// Writes as much of `data` on `stream` as the windows allow and returns how much; the
    /// stream ends with the last byte when `end_stream` and all of it went. The rest waits for
    /// an [`Event::Writable`].
    pub fn send_data(
        &mut self,
        stream: u32,
        data: &[u8],
        end_stream: bool,
    ) -> Result<usize, StreamGone> {
        let s = match self.streams.get_mut(&stream) {
            Some(s) if s.responded && !s.local_ended => s,
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

    /// Resets `stream` (this side gives up on it: the backend failed, the caller is done).
    pub fn reset(&mut self, stream: u32, code: ErrorCode) {
        if self.streams.remove(&stream).is_some() {
            h2::write_rst_stream(&mut self.out, stream, code);
            self.resets.remember(stream);
        }
    }

    /// Says no new streams will be taken (a graceful end): the open ones may finish.
    pub fn go_away(&mut self) {
        if !self.going_away && self.phase != Phase::Failed {
            self.going_away = true;
            h2::write_goaway(&mut self.out, self.last_stream, ErrorCode::NO_ERROR, b"");
        }
    }
}

/// The request's pseudo-header fields taken out of its fields, checked (RFC 9113 8.3.1).
fn request_head(fields: Vec<(Vec<u8>, Vec<u8>)>) -> Result<RequestHead, &'static str> {
    let mut head = RequestHead {
        fields: Vec::with_capacity(fields.len()),
        ..RequestHead::default()
    };
    let mut seen = [false; 4];
    for (name, value) in fields {
        if let Some(pseudo) = name.strip_prefix(b":") {
            if !head.fields.is_empty() {
                return Err("a pseudo-header field after a regular one");
            }
            let (i, slot) = match pseudo {
                b"method" => (0, &mut head.method),
                b"scheme" => (1, &mut head.scheme),
                b"authority" => (2, &mut head.authority),
                b"path" => (3, &mut head.path),
                _ => return Err("an unknown pseudo-header field"),
            };
            if std::mem::replace(&mut seen[i], true) {
                return Err("a pseudo-header field twice");
            }
            check_value(&value)?;
            *slot = value;
            continue;
        }
        check_field(&name, &value)?;
        if h2::connection_specific(&name, &value) {
            return Err(if name == b"te" {
                "TE other than trailers"
            } else {
                "a connection-specific field"
            });
        }
        head.fields.push((name, value));
    }
    if head.method == b"CONNECT" {
        return Err("CONNECT");
    }
    if !head.method.iter().copied().all(is_tchar) {
        return Err("a :method that is not a token");
    }
    if head.path.iter().any(|&b| b <= b' ' || b == 0x7f) {
        return Err("a :path with a space or a control character");
    }
    if !(seen[0] && seen[1] && seen[3]) || head.path.is_empty() {
        return Err("a request without :method, :scheme or :path");
    }
    Ok(head)
}

/// A field's name and value as HTTP/2 allows them (RFC 9113 8.2.1): a lowercase token, and a
/// value without NUL, CR or LF and without whitespace at either end. What the proxy writes into
/// an HTTP/1.1 head for a backend is then one field, never a second line.
pub(crate) fn check_field(name: &[u8], value: &[u8]) -> Result<(), &'static str> {
    if name.is_empty() || !name.iter().copied().all(is_tchar) {
        return Err("a field name that is not a token");
    }
    if name.iter().any(u8::is_ascii_uppercase) {
        return Err("an uppercase field name");
    }
    check_value(value)
}

fn check_value(value: &[u8]) -> Result<(), &'static str> {
    if value.iter().any(|&b| matches!(b, 0 | b'\r' | b'\n')) {
        return Err("a field value with NUL, CR or LF");
    }
    if value
        .first()
        .into_iter()
        .chain(value.last())
        .any(|&b| b == b' ' || b == b'\t')
    {
        return Err("a field value with whitespace at an end");
    }
    Ok(())
}

/// A token's character (RFC 9110 5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A message's `content-length`, if it has one: digits, once (or the same value repeated).
pub(crate) fn content_length(fields: &[(Vec<u8>, Vec<u8>)]) -> Result<Option<u64>, &'static str> {
    let mut length = None;
    for (name, value) in fields {
        if name != b"content-length" {
            continue;
        }
        let n = std::str::from_utf8(value)
            .ok()
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or("a content-length that is not a number")?;
        if length.is_some_and(|l| l != n) {
            return Err("two content-lengths");
        }
        length = Some(n);
    }
    Ok(length)
}

/// HPACK's integer (RFC 7541 5.1) with an `n`-bit prefix under `first`'s high bits.
fn encode_int(out: &mut Vec<u8>, first: u8, n: u8, mut value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

fn encode_str(out: &mut Vec<u8>, s: &[u8]) {
    encode_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

fn encode_status(out: &mut Vec<u8>, status: u16) {
    let indexed = match status {
        200 => 8,
        204 => 9,
        206 => 10,
        304 => 11,
        400 => 12,
        404 => 13,
        500 => 14,
        _ => {
            // A literal with the name of entry 8 (`:status`).
            encode_int(out, 0, 4, 8);
            let digits = itoa_3(status);
            encode_str(out, &digits);
            return;
        }
    };
    encode_int(out, 0x80, 7, indexed);
}

fn itoa_3(status: u16) -> [u8; 3] {
    let s = status.min(999);
    [
        b'0' + (s / 100) as u8,
        b'0' + (s / 10 % 10) as u8,
        b'0' + (s % 10) as u8,
    ]
}

/// A literal field without indexing: the name by its static table entry when it has one.
pub(crate) fn encode_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    match static_name(name) {
        Some(i) => encode_int(out, 0, 4, i),
        None => {
            out.push(0);
            encode_str(out, name);
        }
    }
    encode_str(out, value);
}

/// The static table's first entry of a name (RFC 7541 Appendix A), for the names requests and
/// answers carry.
fn static_name(name: &[u8]) -> Option<usize> {
    Some(match name {
        b":authority" => 1,
        b":method" => 2,
        b":path" => 4,
        b":scheme" => 6,
        b":status" => 8,
        b"accept-charset" => 15,
        b"accept-encoding" => 16,
        b"accept-language" => 17,
        b"accept-ranges" => 18,
        b"accept" => 19,
        b"access-control-allow-origin" => 20,
        b"age" => 21,
        b"allow" => 22,
        b"authorization" => 23,
        b"cache-control" => 24,
        b"content-disposition" => 25,
        b"content-encoding" => 26,
        b"content-language" => 27,
        b"content-length" => 28,
        b"content-location" => 29,
        b"content-range" => 30,
        b"content-type" => 31,
        b"cookie" => 32,
        b"date" => 33,
        b"etag" => 34,
        b"expect" => 35,
        b"expires" => 36,
        b"from" => 37,
        b"host" => 38,
        b"if-match" => 39,
        b"if-modified-since" => 40,
        b"if-none-match" => 41,
        b"if-range" => 42,
        b"if-unmodified-since" => 43,
        b"last-modified" => 44,
        b"link" => 45,
        b"location" => 46,
        b"max-forwards" => 47,
        b"proxy-authenticate" => 48,
        b"proxy-authorization" => 49,
        b"range" => 50,
        b"referer" => 51,
        b"refresh" => 52,
        b"retry-after" => 53,
        b"server" => 54,
        b"set-cookie" => 55,
        b"strict-transport-security" => 56,
        b"transfer-encoding" => 57,
        b"user-agent" => 58,
        b"vary" => 59,
        b"via" => 60,
        b"www-authenticate" => 61,
        _ => return None,
    })
}

impl h2::Reader for Server {
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
            let Frame::Continuation { stream, .. } = frame else {
                return Err(conn(
                    ErrorCode::PROTOCOL_ERROR,
                    "a field block cut by another frame",
                ));
            };
            if stream != c.stream {
                return Err(conn(
                    ErrorCode::PROTOCOL_ERROR,
                    "a CONTINUATION on another stream",
                ));
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
            Frame::GoAway { code, .. } => events.push(Event::GoAway { code }),
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
                if let Some(s) = self.streams.remove(&stream) {
                    if !s.responded {
                        self.early_resets += 1;
                        if self.early_resets > EARLY_RESETS_ALLOWED.max(self.answered) {
                            return Err(conn(
                                ErrorCode::ENHANCE_YOUR_CALM,
                                "too many requests cancelled before their answers",
                            ));
                        }
                    }
                    events.push(Event::Reset { stream, code });
                }
            }
            // Deprecated; may come on any stream, even idle ones.
            Frame::Priority { .. } => {}
            Frame::PushPromise { .. } => {
                return Err(conn(
                    ErrorCode::PROTOCOL_ERROR,
                    "PUSH_PROMISE from a client",
                ));
            }
            Frame::Unknown { .. } => {}
            Frame::Data {
                stream,
                end_stream,
                data,
                flow_len,
            } => {
                self.known(stream)?;
                // The connection's window counts the frame whatever its stream's state.
                self.flow.received(flow_len)?;
                if self.resets.contains(stream) && !self.streams.contains_key(&stream) {
                    // Sent before the client knew of this side's reset: ignored, its bytes
                    // given back to the connection's window.
                    self.give_back(0, flow_len as usize);
                    return Ok(());
                }
                let receiving = h2::open_for_data(
                    stream,
                    self.streams.get_mut(&stream).map(Stream::receiving),
                    "DATA after the request's end",
                );
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
                priority,
            } => {
                let on_itself = priority.is_some_and(|p| p.depends_on == stream);
                if end_headers {
                    self.field_block(stream, end_stream, on_itself, block, events)?;
                } else {
                    self.continuing = Some(Continuing {
                        stream,
                        end_stream,
                        on_itself,
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
                    self.field_block(c.stream, c.end_stream, c.on_itself, &c.block, events)?;
                }
            }
        }
        Ok(())
    }

    /// Sends RST_STREAM for a stream error and forgets the stream, or fails the connection.
    fn stream_error(&mut self, e: H2Error, _events: &mut Vec<Event>) -> Result<(), H2Error> {
        match e {
            H2Error::Stream(stream, code, _) => {
                h2::write_rst_stream(&mut self.out, stream, code);
                self.streams.remove(&stream);
                self.resets.remember(stream);
                Ok(())
            }
            H2Error::Connection(..) => Err(self.fail(e)),
        }
    }

    fn fail(&mut self, e: H2Error) -> H2Error {
        if self.phase != Phase::Failed {
            let why = e.to_string();
            h2::write_goaway(&mut self.out, self.last_stream, e.code(), why.as_bytes());
            self.phase = Phase::Failed;
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::h2::{flag, kind};

    #[test]
    fn static_names_are_the_tables_first_entries() {
        for (name, _) in crate::hpack::STATIC_TABLE {
            let first = crate::hpack::STATIC_TABLE
                .iter()
                .position(|(n, _)| *n == name)
                .unwrap();
            assert_eq!(
                static_name(name),
                Some(first + 1),
                "{}",
                String::from_utf8_lossy(name)
            );
        }
    }

    /// A client's bytes: the preface, an empty SETTINGS, then `frames`.
    fn client(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut out = h2::PREFACE.to_vec();
        h2::write_settings(&mut out, &[]);
        for f in frames {
            out.extend_from_slice(f);
        }
        out
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        h2::write_head(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out
    }

    /// `GET /` on `stream` (HPACK: :method GET, :scheme http, :path /, :authority a).
    fn get(stream: u32, end_stream: bool) -> Vec<u8> {
        let mut block = vec![0x82, 0x86, 0x84, 0x01, 0x01, b'a'];
        block.extend_from_slice(&[0x00, 0x01, b'x', 0x01, b'y']);
        let flags = flag::END_HEADERS | if end_stream { flag::END_STREAM } else { 0 };
        frame(kind::HEADERS, flags, stream, &block)
    }

    /// Every frame in `out`.
    fn frames(out: &[u8]) -> Vec<(h2::Head, Vec<u8>)> {
        let mut at = 0;
        let mut all = Vec::new();
        while let Some(head) = h2::Head::read(&out[at..]) {
            let end = at + h2::HEAD_LEN + head.len as usize;
            all.push((head, out[at + h2::HEAD_LEN..end].to_vec()));
            at = end;
        }
        assert_eq!(at, out.len(), "whole frames");
        all
    }

    /// The first RST_STREAM in `out`: its stream and its code.
    fn first_reset(out: &[u8]) -> (u32, ErrorCode) {
        let (head, payload) = frames(out)
            .into_iter()
            .find(|(h, _)| h.kind == kind::RST_STREAM)
            .expect("a RST_STREAM");
        let code = u32::from_be_bytes(payload[..4].try_into().unwrap());
        (head.stream, ErrorCode(code))
    }

    fn kinds(out: &[u8]) -> Vec<(u8, u32)> {
        frames(out)
            .iter()
            .map(|(h, _)| (h.kind, h.stream))
            .collect()
    }

    fn served(bytes: &[u8]) -> (Server, Vec<Event>, Result<usize, H2Error>) {
        let mut s = Server::new(Config::default());
        s.out().clear();
        let mut events = Vec::new();
        let r = s.recv(bytes, &mut events);
        (s, events, r)
    }

    #[test]
    fn a_request_is_read_and_answered() {
        let bytes = client(&[get(1, true)]);
        let (mut s, events, r) = served(&bytes);
        assert_eq!(r, Ok(bytes.len()));
        assert_eq!(
            events,
            [Event::Request {
                stream: 1,
                head: RequestHead {
                    method: b"GET".to_vec(),
                    scheme: b"http".to_vec(),
                    authority: b"a".to_vec(),
                    path: b"/".to_vec(),
                    fields: vec![(b"x".to_vec(), b"y".to_vec())],
                },
                end_stream: true,
            }]
        );
        // The client's SETTINGS acknowledged.
        assert_eq!(kinds(s.out()), [(kind::SETTINGS, 0)]);
        s.out().clear();
        s.respond(1, 200, [(&b"content-type"[..], &b"text/plain"[..])], false)
            .unwrap();
        assert_eq!(s.send_data(1, b"hello", true), Ok(5));
        assert_eq!(s.open_streams(), 0, "both sides ended");
        let out = frames(s.out());
        assert_eq!(out[0].0.kind, kind::HEADERS);
        assert_eq!(out[0].0.flags, flag::END_HEADERS);
        let mut fields = Vec::new();
        loona_hpack::Decoder::new()
            .decode_with_cb(&out[0].1, |n, v| {
                fields.push((n.into_owned(), v.into_owned()))
            })
            .unwrap();
        assert_eq!(
            fields,
            [
                (b":status".to_vec(), b"200".to_vec()),
                (b"content-type".to_vec(), b"text/plain".to_vec())
            ]
        );
        assert_eq!(out[1].0.kind, kind::DATA);
        assert_eq!(out[1].0.flags, flag::END_STREAM);
        assert_eq!(out[1].1, b"hello");
        assert_eq!(s.send_data(1, b"more", false), Err(StreamGone(1)));
    }

    #[test]
    fn bytes_come_in_any_pieces() {
        let mut body = vec![0; 10];
        body[0] = 9;
        let bytes = client(&[
            get(1, false),
            frame(kind::DATA, flag::END_STREAM | flag::PADDED, 1, &body),
            get(3, true),
        ]);
        let (_, whole, r) = served(&bytes);
        assert_eq!(r, Ok(bytes.len()));
        for step in [1, 2, 7, 9, 24, 33] {
            let mut s = Server::new(Config::default());
            let (mut buf, mut events) = (Vec::new(), Vec::new());
            let mut seen = Vec::new();
            for piece in bytes.chunks(step) {
                buf.extend_from_slice(piece);
                let used = s.recv(&buf, &mut events).unwrap();
                for e in events.drain(..) {
                    // Data ranges are within the buffer given.
                    seen.push(match e {
                        Event::Data {
                            stream,
                            data,
                            end_stream,
                        } => (format!("data {stream} {:?} {end_stream}", &buf[data]), None),
                        e => (String::new(), Some(e)),
                    });
                }
                buf.drain(..used);
            }
            assert!(buf.is_empty());
            let want: Vec<_> = whole
                .iter()
                .map(|e| match e {
                    Event::Data {
                        stream,
                        data,
                        end_stream,
                    } => (
                        format!("data {stream} {:?} {end_stream}", &bytes[data.clone()]),
                        None,
                    ),
                    e => (String::new(), Some(e.clone())),
                })
                .collect();
            assert_eq!(seen, want, "pieces of {step}");
        }
        assert!(matches!(
            whole[1],
            Event::Data {
                stream: 1,
                end_stream: true,
                ..
            }
        ));
    }

    #[test]
    fn a_field_block_may_come_in_continuations_and_nothing_may_cut_it() {
        let whole = get(1, true);
        let block = &whole[h2::HEAD_LEN..];
        let first = frame(kind::HEADERS, flag::END_STREAM, 1, &block[..2]);
        let rest = frame(kind::CONTINUATION, flag::END_HEADERS, 1, &block[2..]);
        let (_, events, r) = served(&client(&[first.clone(), rest.clone()]));
        assert!(r.is_ok());
        assert!(matches!(
            events[0],
            Event::Request {
                stream: 1,
                end_stream: true,
                ..
            }
        ));
        // A PING between them: a connection error; a frame broken on its own stream too.
        let (mut s, _, r) = served(&client(&[
            first.clone(),
            frame(kind::PING, 0, 0, &[0; 8]),
            rest.clone(),
        ]));
        assert_eq!(r.unwrap_err().code(), ErrorCode::PROTOCOL_ERROR);
        assert!(s.failed());
        assert_eq!(kinds(s.out()).last(), Some(&(kind::GOAWAY, 0)));
        let (s, _, r) = served(&client(&[
            first,
            frame(kind::WINDOW_UPDATE, 0, 1, &[0; 4]),
            rest,
        ]));
        assert_eq!(r.unwrap_err().code(), ErrorCode::PROTOCOL_ERROR);
        assert!(s.failed());
    }

    #[test]
    fn the_preface_must_come_first_then_settings() {
        let (s, _, r) = served(b"GET / HTTP/1.1\r\n\r\n");
        assert_eq!(r.unwrap_err().code(), ErrorCode::PROTOCOL_ERROR);
        assert!(s.failed());
        let mut bytes = h2::PREFACE.to_vec();
        bytes.extend_from_slice(&frame(kind::PING, 0, 0, &[0; 8]));
        assert_eq!(
            served(&bytes).2.unwrap_err().code(),
            ErrorCode::PROTOCOL_ERROR
        );
        // Part of it: wait.
        assert_eq!(served(&h2::PREFACE[..10]).2, Ok(0));
    }

    #[test]
    fn the_rules_on_streams_hold() {
        // An even stream, a stream going back, frames on idle streams.
        for (frames, code) in [
            (vec![get(2, true)], ErrorCode::PROTOCOL_ERROR),
            (vec![get(5, true), get(3, true)], ErrorCode::STREAM_CLOSED),
            (
                vec![frame(kind::DATA, 0, 1, b"x")],
                ErrorCode::PROTOCOL_ERROR,
            ),
            (
                vec![frame(kind::RST_STREAM, 0, 1, &[0, 0, 0, 8])],
                ErrorCode::PROTOCOL_ERROR,
            ),
            (
                vec![frame(kind::WINDOW_UPDATE, 0, 1, &[0, 0, 0, 1])],
                ErrorCode::PROTOCOL_ERROR,
            ),
            (
                vec![frame(kind::PUSH_PROMISE, 0, 1, &[0; 4])],
                ErrorCode::PROTOCOL_ERROR,
            ),
        ] {
            let (s, _, r) = served(&client(&frames));
            assert_eq!(r.unwrap_err().code(), code, "{frames:?}");
            assert!(s.failed());
        }
        // DATA after the request's end: that stream's error, the connection goes on.
        let (mut s, events, r) = served(&client(&[
            get(1, false),
            frame(kind::DATA, flag::END_STREAM, 1, b"a"),
            frame(kind::DATA, 0, 1, b"b"),
            get(3, true),
        ]));
        assert!(r.is_ok());
        assert!(!s.failed());
        assert!(matches!(
            events.last(),
            Some(Event::Request { stream: 3, .. })
        ));
        assert_eq!(first_reset(s.out()), (1, ErrorCode::STREAM_CLOSED));
        // A request without :path, or with a connection-specific field: its stream's error.
        for block in [
            vec![0x82, 0x86],
            vec![
                0x82, 0x86, 0x84, 0x00, 0x0a, b'c', b'o', b'n', b'n', b'e', b'c', b't', b'i', b'o',
                b'n', 0x01, b'x',
            ],
            vec![0x82, 0x86, 0x84, 0x00, 0x01, b'X', 0x01, b'x'],
            // A value that would be a second line in an HTTP/1.1 head, a name with a space, a
            // value with a space at its end, a :path with a space.
            vec![
                0x82, 0x86, 0x84, 0x00, 0x01, b'x', 0x05, b'a', b'\r', b'\n', b'b', b':',
            ],
            vec![0x82, 0x86, 0x84, 0x00, 0x02, b'x', b' ', 0x01, b'x'],
            vec![0x82, 0x86, 0x84, 0x00, 0x01, b'x', 0x02, b'x', b' '],
            vec![0x82, 0x86, 0x04, 0x03, b'/', b' ', b'/'],
            vec![0x82, 0x00, 0x01, b'x', 0x01, b'x', 0x86, 0x84],
        ] {
            let (s, events, r) = served(&client(&[frame(
                kind::HEADERS,
                flag::END_HEADERS | flag::END_STREAM,
                1,
                &block,
            )]));
            assert!(r.is_ok(), "{block:?}");
            assert!(events.is_empty(), "{block:?}");
            assert!(!s.failed());
        }
        // A block that does not decode: the connection's error (the tables are out of step).
        let (_, _, r) = served(&client(&[frame(
            kind::HEADERS,
            flag::END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        )]));
        assert_eq!(r.unwrap_err().code(), ErrorCode::COMPRESSION_ERROR);
    }

    #[test]
    fn a_stream_depending_on_itself_is_refused_and_its_block_still_read() {
        // Its block adds `x: y` to the table; the next request names it by index.
        let mut payload = vec![0, 0, 0, 1, 15];
        payload.extend_from_slice(&[0x82, 0x86, 0x84, 0x40, 0x01, b'x', 0x01, b'y']);
        let on_itself = frame(
            kind::HEADERS,
            flag::END_HEADERS | flag::END_STREAM | flag::PRIORITY,
            1,
            &payload,
        );
        let next = frame(
            kind::HEADERS,
            flag::END_HEADERS | flag::END_STREAM,
            3,
            &[0x82, 0x86, 0x84, 0xbe],
        );
        let (mut s, events, r) = served(&client(&[on_itself, next]));
        assert!(r.is_ok());
        let Event::Request {
            stream: 3, head, ..
        } = &events[0]
        else {
            panic!("{events:?}");
        };
        assert_eq!(head.fields, [(b"x".to_vec(), b"y".to_vec())]);
        assert_eq!(first_reset(s.out()), (1, ErrorCode::PROTOCOL_ERROR));
    }

    #[test]
    fn more_streams_than_allowed_are_refused() {
        let mut s = Server::new(Config {
            max_concurrent_streams: 2,
            ..Config::default()
        });
        s.out().clear();
        let mut events = Vec::new();
        let bytes = client(&[get(1, false), get(3, false), get(5, false)]);
        s.recv(&bytes, &mut events).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(first_reset(s.out()), (5, ErrorCode::REFUSED_STREAM));
        // One ends: the next is taken.
        s.reset(1, ErrorCode::CANCEL);
        events.clear();
        s.recv(&get(7, true), &mut events).unwrap();
        assert!(matches!(events[..], [Event::Request { stream: 7, .. }]));
    }

    #[test]
    fn flow_control_holds_both_ways() {
        // This side's answer waits for the client's window.
        let settings = frame(kind::SETTINGS, 0, 0, &[0, 4, 0, 0, 0, 3]);
        let (mut s, events, r) = served(&client(&[settings, get(1, true)]));
        assert!(r.is_ok());
        assert!(matches!(events[0], Event::Request { stream: 1, .. }));
        s.respond(1, 200, [], false).unwrap();
        assert_eq!(s.send_data(1, b"hello", true), Ok(3));
        assert_eq!(s.send_data(1, b"lo", true), Ok(0));
        let mut events = Vec::new();
        s.recv(
            &frame(kind::WINDOW_UPDATE, 0, 1, &[0, 0, 0, 10]),
            &mut events,
        )
        .unwrap();
        assert_eq!(events, [Event::Writable { stream: 1 }]);
        assert_eq!(s.send_data(1, b"lo", true), Ok(2));
        assert_eq!(s.open_streams(), 0);
        // A window past 2^31-1: the stream's error.
        let (mut s, _, _) = served(&client(&[get(1, false)]));
        let mut events = Vec::new();
        s.recv(
            &frame(kind::WINDOW_UPDATE, 0, 1, &0x7fff_ffffu32.to_be_bytes()),
            &mut events,
        )
        .unwrap();
        assert_eq!(s.open_streams(), 0, "reset");

        // The client's body: past the stream's window, that stream's error.
        let config = Config {
            initial_window_size: 8,
            ..Config::default()
        };
        let mut s = Server::new(config);
        let mut events = Vec::new();
        let bytes = client(&[
            get(1, false),
            frame(kind::DATA, 0, 1, &[1; 8]),
            frame(kind::DATA, 0, 1, &[1; 1]),
        ]);
        s.recv(&bytes, &mut events).unwrap();
        assert!(!s.failed());
        assert_eq!(s.open_streams(), 0);
        assert_eq!(kinds(s.out()).last(), Some(&(kind::RST_STREAM, 1)));
        // Given back as handled: a WINDOW_UPDATE once half of the window waits.
        let mut s = Server::new(config);
        let mut events = Vec::new();
        s.recv(
            &client(&[get(1, false), frame(kind::DATA, 0, 1, &[1; 8])]),
            &mut events,
        )
        .unwrap();
        s.out().clear();
        s.consumed(1, 3);
        assert!(s.out().is_empty());
        s.consumed(1, 5);
        let out = frames(s.out());
        assert_eq!(
            (out[0].0.kind, out[0].0.stream, &out[0].1[..]),
            (kind::WINDOW_UPDATE, 1, &8u32.to_be_bytes()[..])
        );
        events.clear();
        s.recv(
            &frame(kind::DATA, flag::END_STREAM, 1, &[1; 8]),
            &mut events,
        )
        .unwrap();
        assert!(matches!(
            events[..],
            [Event::Data {
                end_stream: true,
                ..
            }]
        ));
    }

    #[test]
    fn a_body_unlike_its_content_length_resets_its_stream_and_keeps_the_connections_window() {
        let config = Config {
            connection_window: 65_535,
            ..Config::default()
        };
        let mut s = Server::new(config);
        let mut events = Vec::new();
        let mut bytes = client(&[]);
        // Forty requests of 2,000 bytes each saying 1,000: more than the connection's window
        // unless what was refused is given back.
        for i in 0..40u32 {
            let stream = 2 * i + 1;
            let mut block = vec![0x83, 0x86, 0x84];
            block.extend_from_slice(&[0x0f, 0x0d, 0x04, b'1', b'0', b'0', b'0']);
            bytes.extend_from_slice(&frame(kind::HEADERS, flag::END_HEADERS, stream, &block));
            bytes.extend_from_slice(&frame(kind::DATA, flag::END_STREAM, stream, &[0; 2000]));
        }
        s.recv(&bytes, &mut events).unwrap();
        assert!(!s.failed());
        assert_eq!(events.len(), 40, "the requests, and no data");
        let out = frames(s.out());
        let resets = out
            .iter()
            .filter(|(h, _)| h.kind == kind::RST_STREAM)
            .count();
        assert_eq!(resets, 40);
        let given: u32 = out
            .iter()
            .filter(|(h, _)| h.kind == kind::WINDOW_UPDATE && h.stream == 0)
            .map(|(_, p)| u32::from_be_bytes(p[..4].try_into().unwrap()))
            .sum();
        assert!(given >= 40 * 2000 - 65_535, "{given}");
        // Shorter than said: the same.
        let mut s = Server::new(Config::default());
        let mut block = vec![0x83, 0x86, 0x84];
        block.extend_from_slice(&[0x0f, 0x0d, 0x01, b'5']);
        let bytes = client(&[
            frame(kind::HEADERS, flag::END_HEADERS, 1, &block),
            frame(kind::DATA, flag::END_STREAM, 1, b"1234"),
        ]);
        let mut events = Vec::new();
        s.recv(&bytes, &mut events).unwrap();
        assert_eq!(kinds(s.out()).last(), Some(&(kind::RST_STREAM, 1)));
        // Just as said: the body.
        let mut s = Server::new(Config::default());
        let bytes = client(&[
            frame(kind::HEADERS, flag::END_HEADERS, 1, &block),
            frame(kind::DATA, 0, 1, b"12"),
            frame(kind::DATA, flag::END_STREAM, 1, b"345"),
        ]);
        let mut events = Vec::new();
        s.recv(&bytes, &mut events).unwrap();
        assert!(matches!(
            events[2],
            Event::Data {
                end_stream: true,
                ..
            }
        ));
        // Giving back more than was sent opens no window past the one given.
        s.out().clear();
        s.consumed(1, usize::MAX);
        for (h, p) in frames(s.out()) {
            assert_eq!(h.kind, kind::WINDOW_UPDATE);
            assert!(u32::from_be_bytes(p[..4].try_into().unwrap()) <= 5);
        }
    }

    #[test]
    fn what_the_client_sent_before_it_knew_of_a_reset_is_ignored() {
        let (mut s, _, _) = served(&client(&[get(1, false), get(3, false)]));
        s.reset(1, ErrorCode::CANCEL);
        s.out().clear();
        let mut events = Vec::new();
        // Its body and trailers (a literal with incremental indexing: the table must follow).
        let trailers = [0x40, 0x01, b't', 0x01, b'v'];
        let bytes = [
            frame(kind::DATA, 0, 1, &[0; 100]),
            frame(
                kind::HEADERS,
                flag::END_HEADERS | flag::END_STREAM,
                1,
                &trailers,
            ),
            frame(kind::WINDOW_UPDATE, 0, 1, &[0, 0, 0, 9]),
            frame(kind::RST_STREAM, 0, 1, &[0, 0, 0, 8]),
            // Then trailers on stream 3 naming the entry the ignored block added.
            frame(kind::DATA, 0, 3, b"x"),
            frame(
                kind::HEADERS,
                flag::END_HEADERS | flag::END_STREAM,
                3,
                &[0xbe],
            ),
        ]
        .concat();
        assert_eq!(s.recv(&bytes, &mut events), Ok(bytes.len()));
        assert!(!s.failed());
        assert_eq!(
            events[1],
            Event::Trailers {
                stream: 3,
                fields: vec![(b"t".to_vec(), b"v".to_vec())]
            }
        );
        assert!(
            !kinds(s.out()).contains(&(kind::RST_STREAM, 1)),
            "no error for them"
        );
        // A stream closed by both ends, not reset by this side: HEADERS on it are an error.
        let (mut s, _, _) = served(&client(&[get(1, true)]));
        s.respond(1, 200, [], true).unwrap();
        let mut events = Vec::new();
        let r = s.recv(
            &frame(
                kind::HEADERS,
                flag::END_HEADERS | flag::END_STREAM,
                1,
                &[0x40, 0x01, b't', 0x01, b'v'],
            ),
            &mut events,
        );
        assert_eq!(r.unwrap_err().code(), ErrorCode::STREAM_CLOSED);
    }

    #[test]
    fn a_client_resetting_its_requests_faster_than_they_are_answered_is_refused() {
        let mut s = Server::new(Config::default());
        let mut events = Vec::new();
        s.recv(&client(&[]), &mut events).unwrap();
        let mut r = Ok(0);
        let mut stream = 1;
        while r.is_ok() && stream < 2 * 5_000 {
            let bytes = [
                get(stream, true),
                frame(kind::RST_STREAM, 0, stream, &[0, 0, 0, 8]),
            ]
            .concat();
            r = s.recv(&bytes, &mut events);
            stream += 2;
        }
        assert_eq!(r.unwrap_err().code(), ErrorCode::ENHANCE_YOUR_CALM);
        assert_eq!((stream - 1) / 2, EARLY_RESETS_ALLOWED as u32 + 1);
        // Answered ones count for the client.
        let mut s = Server::new(Config::default());
        s.recv(&client(&[]), &mut events).unwrap();
        for i in 0..3_000u32 {
            let stream = 2 * i + 1;
            s.recv(&get(stream, false), &mut events).unwrap();
            if i % 2 == 0 {
                s.respond(stream, 200, [], false).unwrap();
            }
            s.recv(
                &frame(kind::RST_STREAM, 0, stream, &[0, 0, 0, 8]),
                &mut events,
            )
            .unwrap();
        }
        assert!(!s.failed());
    }

    #[test]
    fn pings_and_settings_are_answered() {
        let (mut s, _, r) = served(&client(&[frame(kind::PING, 0, 0, b"abcdefgh")]));
        assert!(r.is_ok());
        let out = frames(s.out());
        assert_eq!(out[0].0.kind, kind::SETTINGS);
        assert_eq!(out[0].0.flags, flag::ACK);
        assert_eq!(
            (out[1].0.kind, out[1].0.flags, &out[1].1[..]),
            (kind::PING, flag::ACK, &b"abcdefgh"[..])
        );
        // A bad setting: the connection's error.
        let (_, _, r) = served(&client(&[frame(kind::SETTINGS, 0, 0, &[0, 2, 0, 0, 0, 2])]));
        assert_eq!(r.unwrap_err().code(), ErrorCode::PROTOCOL_ERROR);
    }

    #[test]
    fn answers_encode_any_status_and_long_fields() {
        let (mut s, _, _) = served(&client(&[get(1, true), get(3, true)]));
        let long = vec![b'v'; 300];
        s.respond(
            1,
            503,
            [
                (&b"retry-after"[..], &b"1"[..]),
                (&b"x-long"[..], &long[..]),
            ],
            true,
        )
        .unwrap();
        s.respond(3, 404, [], true).unwrap();
        let out = frames(s.out());
        let mut decoder = loona_hpack::Decoder::new();
        let mut blocks = out
            .iter()
            .filter(|(h, _)| h.kind == kind::HEADERS)
            .map(|(_, b)| {
                let mut fields = Vec::new();
                decoder
                    .decode_with_cb(b, |n, v| fields.push((n.into_owned(), v.into_owned())))
                    .unwrap();
                fields
            });
        assert_eq!(
            blocks.next().unwrap(),
            [
                (b":status".to_vec(), b"503".to_vec()),
                (b"retry-after".to_vec(), b"1".to_vec()),
                (b"x-long".to_vec(), long.clone())
            ]
        );
        assert_eq!(
            blocks.next().unwrap(),
            [(b":status".to_vec(), b"404".to_vec())]
        );
    }

    #[test]
    fn a_graceful_end_refuses_new_streams_and_lets_the_open_ones_finish() {
        let (mut s, _, _) = served(&client(&[get(1, true)]));
        s.go_away();
        let mut events = Vec::new();
        s.recv(&get(3, true), &mut events).unwrap();
        assert!(events.is_empty());
        s.respond(1, 200, [], true).unwrap();
        let k = kinds(s.out());
        assert!(k.contains(&(kind::GOAWAY, 0)));
        assert!(k.contains(&(kind::RST_STREAM, 3)));
        assert_eq!(k.last(), Some(&(kind::HEADERS, 1)));
    }
}
