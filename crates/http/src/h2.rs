//! HTTP/2 framing (RFC 9113 sections 4 and 6), with no IO: frames read from a buffer without
//! copying their payloads, each type's rules checked as it is read, and frames written into a
//! buffer. The errors say what the RFC says the reader must do: a connection error (GOAWAY
//! with the code, then close) or a stream error (RST_STREAM on that stream, the connection
//! goes on).
//!
//! It is the bottom layer of ebb's own HTTP/2: the `h2` crate's work is about half of ebb's CPU
//! on gRPC and a quarter on h2c, where HAProxy's own framing costs less. What it leaves to the
//! layer above: stream states, flow control windows, HPACK, and the order of frames
//! (CONTINUATION following its HEADERS).

use std::fmt;

/// What a client sends first (RFC 9113 section 3.4), then a SETTINGS frame.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A frame's head: length (24 bits), type, flags, stream (31 bits).
pub const HEAD_LEN: usize = 9;

/// The largest frame payload before SETTINGS_MAX_FRAME_SIZE says otherwise, and the least it
/// may say.
pub const DEFAULT_MAX_FRAME_SIZE: u32 = 16_384;

/// The most SETTINGS_MAX_FRAME_SIZE may say.
pub const MAX_MAX_FRAME_SIZE: u32 = (1 << 24) - 1;

/// The largest flow-control window (and SETTINGS_INITIAL_WINDOW_SIZE).
pub const MAX_WINDOW: u32 = (1 << 31) - 1;

/// A window before SETTINGS_INITIAL_WINDOW_SIZE says otherwise, and the connection's.
pub const DEFAULT_WINDOW: u32 = 65_535;

/// The frame types (RFC 9113 section 6).
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const PRIORITY: u8 = 0x2;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// The flags this layer reads and writes.
pub mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// The error codes (RFC 9113 section 7); an unknown code read from a peer is kept as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u32);

impl ErrorCode {
    pub const NO_ERROR: Self = Self(0x0);
    pub const PROTOCOL_ERROR: Self = Self(0x1);
    pub const INTERNAL_ERROR: Self = Self(0x2);
    pub const FLOW_CONTROL_ERROR: Self = Self(0x3);
    pub const SETTINGS_TIMEOUT: Self = Self(0x4);
    pub const STREAM_CLOSED: Self = Self(0x5);
    pub const FRAME_SIZE_ERROR: Self = Self(0x6);
    pub const REFUSED_STREAM: Self = Self(0x7);
    pub const CANCEL: Self = Self(0x8);
    pub const COMPRESSION_ERROR: Self = Self(0x9);
    pub const CONNECT_ERROR: Self = Self(0xa);
    pub const ENHANCE_YOUR_CALM: Self = Self(0xb);
    pub const INADEQUATE_SECURITY: Self = Self(0xc);
    pub const HTTP_1_1_REQUIRED: Self = Self(0xd);

    /// The code's name in the RFC, for logs.
    pub fn name(self) -> &'static str {
        const NAMES: [&str; 14] = [
            "NO_ERROR",
            "PROTOCOL_ERROR",
            "INTERNAL_ERROR",
            "FLOW_CONTROL_ERROR",
            "SETTINGS_TIMEOUT",
            "STREAM_CLOSED",
            "FRAME_SIZE_ERROR",
            "REFUSED_STREAM",
            "CANCEL",
            "COMPRESSION_ERROR",
            "CONNECT_ERROR",
            "ENHANCE_YOUR_CALM",
            "INADEQUATE_SECURITY",
            "HTTP_1_1_REQUIRED",
        ];
        usize::try_from(self.0)
            .ok()
            .and_then(|i| NAMES.get(i))
            .copied()
            .unwrap_or("UNKNOWN")
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (0x{:x})", self.name(), self.0)
    }
}

/// What breaks the rules, and what the reader does about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum H2Error {
    /// GOAWAY with the code, then close the connection.
    #[error("connection error {0}: {1}")]
    Connection(ErrorCode, &'static str),
    /// RST_STREAM on the stream with the code; the connection goes on.
    #[error("stream {0} error {1}: {2}")]
    Stream(u32, ErrorCode, &'static str),
}

impl H2Error {
    /// The code to send.
    pub fn code(self) -> ErrorCode {
        match self {
            H2Error::Connection(c, _) | H2Error::Stream(_, c, _) => c,
        }
    }
}

fn conn(code: ErrorCode, why: &'static str) -> H2Error {
    H2Error::Connection(code, why)
}

/// A stream's dependency in a HEADERS or PRIORITY frame. Deprecated (RFC 9113 section 5.3.2):
/// read only to check it and skip it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Priority {
    pub exclusive: bool,
    pub depends_on: u32,
    /// As sent: 0 to 255 stands for a weight of 1 to 256.
    pub weight: u8,
}

/// One frame, its payload borrowed from the buffer it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    Data {
        stream: u32,
        end_stream: bool,
        /// Without its padding.
        data: &'a [u8],
        /// The whole payload's length, padding included: what flow control counts.
        flow_len: u32,
    },
    Headers {
        stream: u32,
        end_stream: bool,
        end_headers: bool,
        priority: Option<Priority>,
        /// The field block fragment, without padding and priority.
        block: &'a [u8],
    },
    Priority {
        stream: u32,
        priority: Priority,
    },
    RstStream {
        stream: u32,
        code: ErrorCode,
    },
    Settings {
        ack: bool,
        /// Whole 6-byte entries ([`SettingsEntries`] reads them).
        entries: &'a [u8],
    },
    PushPromise {
        stream: u32,
    },
    Ping {
        ack: bool,
        payload: [u8; 8],
    },
    GoAway {
        last_stream: u32,
        code: ErrorCode,
        debug: &'a [u8],
    },
    WindowUpdate {
        stream: u32,
        increment: u32,
    },
    Continuation {
        stream: u32,
        end_headers: bool,
        block: &'a [u8],
    },
    /// A type this layer does not know: to be ignored (RFC 9113 section 4.1), unless it comes
    /// between a HEADERS and its CONTINUATION.
    Unknown {
        kind: u8,
        stream: u32,
    },
}

impl Frame<'_> {
    /// The stream the frame is on (0: the connection).
    pub fn stream(&self) -> u32 {
        match *self {
            Frame::Data { stream, .. }
            | Frame::Headers { stream, .. }
            | Frame::Priority { stream, .. }
            | Frame::RstStream { stream, .. }
            | Frame::PushPromise { stream }
            | Frame::WindowUpdate { stream, .. }
            | Frame::Continuation { stream, .. }
            | Frame::Unknown { stream, .. } => stream,
            Frame::Settings { .. } | Frame::Ping { .. } | Frame::GoAway { .. } => 0,
        }
    }
}

/// A frame's head as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub len: u32,
    pub kind: u8,
    pub flags: u8,
    /// Without the reserved bit.
    pub stream: u32,
}

impl Head {
    /// The head at the start of `buf`, if it is all there.
    pub fn read(buf: &[u8]) -> Option<Head> {
        let h: &[u8; HEAD_LEN] = buf.get(..HEAD_LEN)?.try_into().ok()?;
        Some(Head {
            len: u32::from_be_bytes([0, h[0], h[1], h[2]]),
            kind: h[3],
            flags: h[4],
            stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & MAX_WINDOW,
        })
    }
}

/// Reads the frame at the start of `buf`: `Ok(None)` until all of it is there, then the frame
/// and how many bytes it took. `max_frame_size` is this side's SETTINGS_MAX_FRAME_SIZE: a
/// larger frame is refused from its head alone, before its payload is read.
pub fn read(buf: &[u8], max_frame_size: u32) -> Result<Option<(Frame<'_>, usize)>, H2Error> {
    let Some(head) = Head::read(buf) else {
        return Ok(None);
    };
    if head.len > max_frame_size {
        // Any frame may alter the connection's state as far as this layer knows (a field
        // block, SETTINGS, stream 0): a connection error is always right (RFC 9113 4.2).
        return Err(conn(
            ErrorCode::FRAME_SIZE_ERROR,
            "a frame larger than SETTINGS_MAX_FRAME_SIZE",
        ));
    }
    let total = HEAD_LEN + head.len as usize;
    let Some(payload) = buf.get(HEAD_LEN..total) else {
        return Ok(None);
    };
    Ok(Some((parse(head, payload)?, total)))
}

/// The frame of `head` with all of its `payload`.
pub fn parse(head: Head, payload: &[u8]) -> Result<Frame<'_>, H2Error> {
    let Head {
        kind,
        flags,
        stream,
        ..
    } = head;
    let on_stream = |what: &'static str| {
        if stream == 0 {
            Err(conn(ErrorCode::PROTOCOL_ERROR, what))
        } else {
            Ok(())
        }
    };
    let on_connection = |what: &'static str| {
        if stream != 0 {
            Err(conn(ErrorCode::PROTOCOL_ERROR, what))
        } else {
            Ok(())
        }
    };
    Ok(match kind {
        kind::DATA => {
            on_stream("DATA on stream 0")?;
            let data = unpad(flags, payload)?;
            Frame::Data {
                stream,
                end_stream: flags & flag::END_STREAM != 0,
                data,
                flow_len: payload.len() as u32,
            }
        }
        kind::HEADERS => {
            on_stream("HEADERS on stream 0")?;
            let mut block = unpad(flags, payload)?;
            let priority = if flags & flag::PRIORITY != 0 {
                let Some((p, rest)) = block.split_first_chunk::<5>() else {
                    return Err(conn(
                        ErrorCode::FRAME_SIZE_ERROR,
                        "HEADERS too short for its priority",
                    ));
                };
                block = rest;
                // A stream depending on itself is a stream error, which the reader raises
                // once it has decoded the field block (its HPACK table must follow it).
                Some(priority(p))
            } else {
                None
            };
            Frame::Headers {
                stream,
                end_stream: flags & flag::END_STREAM != 0,
                end_headers: flags & flag::END_HEADERS != 0,
                priority,
                block,
            }
        }
        kind::PRIORITY => {
            on_stream("PRIORITY on stream 0")?;
            let Ok(p) = <&[u8; 5]>::try_from(payload) else {
                return Err(H2Error::Stream(
                    stream,
                    ErrorCode::FRAME_SIZE_ERROR,
                    "PRIORITY not 5 bytes long",
                ));
            };
            let priority = priority(p);
            if priority.depends_on == stream {
                return Err(H2Error::Stream(
                    stream,
                    ErrorCode::PROTOCOL_ERROR,
                    "a stream that depends on itself",
                ));
            }
            Frame::Priority { stream, priority }
        }
        kind::RST_STREAM => {
            on_stream("RST_STREAM on stream 0")?;
            let Ok(c) = <[u8; 4]>::try_from(payload) else {
                return Err(conn(
                    ErrorCode::FRAME_SIZE_ERROR,
                    "RST_STREAM not 4 bytes long",
                ));
            };
            Frame::RstStream {
                stream,
                code: ErrorCode(u32::from_be_bytes(c)),
            }
        }
        kind::SETTINGS => {
            on_connection("SETTINGS on a stream")?;
            let ack = flags & flag::ACK != 0;
            if ack && !payload.is_empty() {
                return Err(conn(
                    ErrorCode::FRAME_SIZE_ERROR,
                    "a SETTINGS acknowledgement with a payload",
                ));
            }
            if !payload.len().is_multiple_of(6) {
                return Err(conn(
                    ErrorCode::FRAME_SIZE_ERROR,
                    "SETTINGS not a multiple of 6 bytes long",
                ));
            }
            Frame::Settings {
                ack,
                entries: payload,
            }
        }
        kind::PUSH_PROMISE => {
            on_stream("PUSH_PROMISE on stream 0")?;
            Frame::PushPromise { stream }
        }
        kind::PING => {
            on_connection("PING on a stream")?;
            let Ok(payload) = <[u8; 8]>::try_from(payload) else {
                return Err(conn(ErrorCode::FRAME_SIZE_ERROR, "PING not 8 bytes long"));
            };
            Frame::Ping {
                ack: flags & flag::ACK != 0,
                payload,
            }
        }
        kind::GOAWAY => {
            on_connection("GOAWAY on a stream")?;
            let Some((fixed, debug)) = payload.split_first_chunk::<8>() else {
                return Err(conn(
                    ErrorCode::FRAME_SIZE_ERROR,
                    "GOAWAY shorter than 8 bytes",
                ));
            };
            Frame::GoAway {
                last_stream: u32::from_be_bytes([fixed[0], fixed[1], fixed[2], fixed[3]])
                    & MAX_WINDOW,
                code: ErrorCode(u32::from_be_bytes([fixed[4], fixed[5], fixed[6], fixed[7]])),
                debug,
            }
        }
        kind::WINDOW_UPDATE => {
            let Ok(i) = <[u8; 4]>::try_from(payload) else {
                return Err(conn(
                    ErrorCode::FRAME_SIZE_ERROR,
                    "WINDOW_UPDATE not 4 bytes long",
                ));
            };
            let increment = u32::from_be_bytes(i) & MAX_WINDOW;
            if increment == 0 {
                let why = "a WINDOW_UPDATE of 0";
                return Err(if stream == 0 {
                    conn(ErrorCode::PROTOCOL_ERROR, why)
                } else {
                    H2Error::Stream(stream, ErrorCode::PROTOCOL_ERROR, why)
                });
            }
            Frame::WindowUpdate { stream, increment }
        }
        kind::CONTINUATION => {
            on_stream("CONTINUATION on stream 0")?;
            Frame::Continuation {
                stream,
                end_headers: flags & flag::END_HEADERS != 0,
                block: payload,
            }
        }
        kind => Frame::Unknown { kind, stream },
    })
}

/// A DATA or HEADERS payload without its padding.
fn unpad(flags: u8, payload: &[u8]) -> Result<&[u8], H2Error> {
    if flags & flag::PADDED == 0 {
        return Ok(payload);
    }
    let Some((&pad, rest)) = payload.split_first() else {
        return Err(conn(
            ErrorCode::FRAME_SIZE_ERROR,
            "a padded frame without its pad length",
        ));
    };
    // The padding may not take the whole payload (RFC 9113 6.1, 6.2).
    rest.len()
        .checked_sub(usize::from(pad))
        .map(|len| &rest[..len])
        .ok_or(conn(
            ErrorCode::PROTOCOL_ERROR,
            "padding as long as the payload or longer",
        ))
}

fn priority(p: &[u8; 5]) -> Priority {
    let dep = u32::from_be_bytes([p[0], p[1], p[2], p[3]]);
    Priority {
        exclusive: dep & !MAX_WINDOW != 0,
        depends_on: dep & MAX_WINDOW,
        weight: p[4],
    }
}

/// The SETTINGS identifiers (RFC 9113 section 6.5.2).
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// The entries of a SETTINGS frame, in order: `(identifier, value)`.
pub struct SettingsEntries<'a>(std::slice::ChunksExact<'a, u8>);

impl<'a> SettingsEntries<'a> {
    /// The entries of a [`Frame::Settings`]'s `entries`.
    pub fn new(entries: &'a [u8]) -> Self {
        Self(entries.chunks_exact(6))
    }
}

impl Iterator for SettingsEntries<'_> {
    type Item = (u16, u32);

    fn next(&mut self) -> Option<(u16, u32)> {
        let e = self.0.next()?;
        Some((
            u16::from_be_bytes([e[0], e[1]]),
            u32::from_be_bytes([e[2], e[3], e[4], e[5]]),
        ))
    }
}

/// One side's settings, as its SETTINGS frames set them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub header_table_size: u32,
    pub enable_push: bool,
    /// `None`: no limit said.
    pub max_concurrent_streams: Option<u32>,
    pub initial_window_size: u32,
    pub max_frame_size: u32,
    /// `None`: no limit said.
    pub max_header_list_size: Option<u32>,
}

impl Default for Settings {
    /// What holds before a SETTINGS frame says otherwise.
    fn default() -> Self {
        Self {
            header_table_size: 4_096,
            enable_push: true,
            max_concurrent_streams: None,
            initial_window_size: DEFAULT_WINDOW,
            max_frame_size: DEFAULT_MAX_FRAME_SIZE,
            max_header_list_size: None,
        }
    }
}

impl Settings {
    /// Takes a SETTINGS frame's entries in order; an unknown identifier is ignored. On a value
    /// out of its range, the entries before it hold and the error is a connection error.
    pub fn apply(&mut self, entries: &[u8]) -> Result<(), H2Error> {
        for (id, value) in SettingsEntries::new(entries) {
            match id {
                setting::HEADER_TABLE_SIZE => self.header_table_size = value,
                setting::ENABLE_PUSH => {
                    self.enable_push = match value {
                        0 => false,
                        1 => true,
                        _ => {
                            return Err(conn(
                                ErrorCode::PROTOCOL_ERROR,
                                "SETTINGS_ENABLE_PUSH neither 0 nor 1",
                            ));
                        }
                    }
                }
                setting::MAX_CONCURRENT_STREAMS => self.max_concurrent_streams = Some(value),
                setting::INITIAL_WINDOW_SIZE => {
                    if value > MAX_WINDOW {
                        return Err(conn(
                            ErrorCode::FLOW_CONTROL_ERROR,
                            "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1",
                        ));
                    }
                    self.initial_window_size = value;
                }
                setting::MAX_FRAME_SIZE => {
                    if !(DEFAULT_MAX_FRAME_SIZE..=MAX_MAX_FRAME_SIZE).contains(&value) {
                        return Err(conn(
                            ErrorCode::PROTOCOL_ERROR,
                            "SETTINGS_MAX_FRAME_SIZE outside 2^14..2^24-1",
                        ));
                    }
                    self.max_frame_size = value;
                }
                setting::MAX_HEADER_LIST_SIZE => self.max_header_list_size = Some(value),
                _ => {}
            }
        }
        Ok(())
    }
}

/// Writes a frame's head.
pub fn write_head(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    debug_assert!(len <= MAX_MAX_FRAME_SIZE as usize, "a frame of {len} bytes");
    let len = (len as u32).to_be_bytes();
    out.extend_from_slice(&[len[1], len[2], len[3], kind, flags]);
    out.extend_from_slice(&(stream & MAX_WINDOW).to_be_bytes());
}

/// Writes a SETTINGS frame with `entries`.
pub fn write_settings(out: &mut Vec<u8>, entries: &[(u16, u32)]) {
    write_head(out, entries.len() * 6, kind::SETTINGS, 0, 0);
    for (id, value) in entries {
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&value.to_be_bytes());
    }
}

/// Writes the acknowledgement of a SETTINGS frame.
pub fn write_settings_ack(out: &mut Vec<u8>) {
    write_head(out, 0, kind::SETTINGS, flag::ACK, 0);
}

/// Writes a PING, or its answer (`ack`).
pub fn write_ping(out: &mut Vec<u8>, ack: bool, payload: [u8; 8]) {
    write_head(out, 8, kind::PING, if ack { flag::ACK } else { 0 }, 0);
    out.extend_from_slice(&payload);
}

/// Writes a WINDOW_UPDATE (stream 0: the connection's window).
pub fn write_window_update(out: &mut Vec<u8>, stream: u32, increment: u32) {
    debug_assert!((1..=MAX_WINDOW).contains(&increment));
    write_head(out, 4, kind::WINDOW_UPDATE, 0, stream);
    out.extend_from_slice(&(increment & MAX_WINDOW).to_be_bytes());
}

/// Writes a RST_STREAM.
pub fn write_rst_stream(out: &mut Vec<u8>, stream: u32, code: ErrorCode) {
    write_head(out, 4, kind::RST_STREAM, 0, stream);
    out.extend_from_slice(&code.0.to_be_bytes());
}

/// Writes a GOAWAY: the last stream this side took, why, and a note for the peer's logs.
pub fn write_goaway(out: &mut Vec<u8>, last_stream: u32, code: ErrorCode, debug: &[u8]) {
    write_head(out, 8 + debug.len(), kind::GOAWAY, 0, 0);
    out.extend_from_slice(&(last_stream & MAX_WINDOW).to_be_bytes());
    out.extend_from_slice(&code.0.to_be_bytes());
    out.extend_from_slice(debug);
}

/// Writes a field block as a HEADERS frame and as many CONTINUATION frames as the peer's
/// `max_frame_size` needs.
pub fn write_headers(
    out: &mut Vec<u8>,
    stream: u32,
    block: &[u8],
    end_stream: bool,
    max_frame_size: u32,
) {
    let max = (max_frame_size as usize).max(DEFAULT_MAX_FRAME_SIZE as usize);
    let mut chunks = block.chunks(max);
    let first = chunks.next().unwrap_or_default();
    let rest = chunks.len();
    let mut flags = if end_stream { flag::END_STREAM } else { 0 };
    if rest == 0 {
        flags |= flag::END_HEADERS;
    }
    write_head(out, first.len(), kind::HEADERS, flags, stream);
    out.extend_from_slice(first);
    for (i, chunk) in chunks.enumerate() {
        let flags = if i + 1 == rest { flag::END_HEADERS } else { 0 };
        write_head(out, chunk.len(), kind::CONTINUATION, flags, stream);
        out.extend_from_slice(chunk);
    }
}

/// Writes `data` as DATA frames of at most `max_frame_size` bytes, the last one ending the
/// stream when `end_stream` (no data and `end_stream`: one empty frame that ends it).
pub fn write_data(
    out: &mut Vec<u8>,
    stream: u32,
    data: &[u8],
    end_stream: bool,
    max_frame_size: u32,
) {
    if data.is_empty() {
        if end_stream {
            write_data_head(out, stream, 0, true);
        }
        return;
    }
    let mut chunks = data.chunks(max_frame_size as usize).peekable();
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        write_data_head(out, stream, chunk.len(), end_stream && last);
        out.extend_from_slice(chunk);
    }
}

/// One side's flow control on a connection (RFC 9113 sections 5.2 and 6.9): the connection's
/// windows both ways and what the caller handled since this side last gave any back. Each
/// stream's windows are [`Windows`], kept by the side with its stream.
#[derive(Debug)]
pub struct Flow {
    /// The window each stream this side receives on starts with.
    stream_window: u32,
    /// The connection's receive window this side keeps open.
    connection_window: u32,
    send: i64,
    recv: i64,
    unacked: u32,
}

/// What a DATA frame needs of the stream it came on: its windows, whether the peer ended its
/// side, and what of its body its `content-length` leaves.
pub struct Receiving<'a> {
    pub windows: &'a mut Windows,
    pub remote_ended: &'a mut bool,
    pub body_left: &'a mut Option<u64>,
}

/// A stream's windows: what this side may still send on it, what the peer may.
#[derive(Debug)]
pub struct Windows {
    send: i64,
    recv: i64,
    unacked: u32,
}

impl Windows {
    /// Whether this side may send some bytes on the stream, as far as its own window goes.
    pub fn open(&self) -> bool {
        self.send > 0
    }
}

impl Flow {
    /// Flow control with `stream_window` for each stream this side receives on and
    /// `connection_window` for the connection; the connection window's raise past the
    /// default goes to `out`.
    pub fn new(stream_window: u32, connection_window: u32, out: &mut Vec<u8>) -> Self {
        let default_window = i64::from(DEFAULT_WINDOW);
        let raise = i64::from(connection_window) - default_window;
        if raise > 0 {
            write_window_update(out, 0, raise as u32);
        }
        Self {
            stream_window,
            connection_window,
            send: default_window,
            recv: default_window.max(i64::from(connection_window)),
            unacked: 0,
        }
    }

    /// A new stream's windows: the peer's initial window to send into, this side's to
    /// receive.
    pub fn stream(&self, peer_initial_window: u32) -> Windows {
        Windows {
            send: i64::from(peer_initial_window),
            recv: i64::from(self.stream_window),
            unacked: 0,
        }
    }

    /// The peer's SETTINGS_INITIAL_WINDOW_SIZE moved from `before` to `after`: every stream's
    /// send window moves by as much. Returns whether they grew (data held back may go).
    pub fn initial_window_moved<'a>(
        before: u32,
        after: u32,
        streams: impl Iterator<Item = &'a mut Windows>,
    ) -> Result<bool, H2Error> {
        let delta = i64::from(after) - i64::from(before);
        if delta == 0 {
            return Ok(false);
        }
        for w in streams {
            w.send += delta;
            if w.send > i64::from(MAX_WINDOW) {
                return Err(H2Error::Connection(
                    ErrorCode::FLOW_CONTROL_ERROR,
                    "SETTINGS_INITIAL_WINDOW_SIZE took a window past 2^31-1",
                ));
            }
        }
        Ok(delta > 0)
    }

    /// A WINDOW_UPDATE on the connection.
    pub fn connection_update(&mut self, increment: u32) -> Result<(), H2Error> {
        self.send += i64::from(increment);
        if self.send > i64::from(MAX_WINDOW) {
            return Err(H2Error::Connection(
                ErrorCode::FLOW_CONTROL_ERROR,
                "the connection's window past 2^31-1",
            ));
        }
        Ok(())
    }

    /// A WINDOW_UPDATE on `stream`, whose windows are `w`.
    pub fn stream_update(w: &mut Windows, stream: u32, increment: u32) -> Result<(), H2Error> {
        w.send += i64::from(increment);
        if w.send > i64::from(MAX_WINDOW) {
            return Err(H2Error::Stream(
                stream,
                ErrorCode::FLOW_CONTROL_ERROR,
                "a stream's window past 2^31-1",
            ));
        }
        Ok(())
    }

    /// A DATA frame of `flow_len` bytes (padding included) counted against the connection's
    /// window, whatever its stream's state.
    pub fn received(&mut self, flow_len: u32) -> Result<(), H2Error> {
        self.recv -= i64::from(flow_len);
        if self.recv < 0 {
            return Err(H2Error::Connection(
                ErrorCode::FLOW_CONTROL_ERROR,
                "DATA past the connection's window",
            ));
        }
        Ok(())
    }

    /// The same frame counted against its stream's window: past it, the stream's error.
    pub fn stream_received(w: &mut Windows, stream: u32, flow_len: u32) -> Option<H2Error> {
        w.recv -= i64::from(flow_len);
        (w.recv < 0).then_some(H2Error::Stream(
            stream,
            ErrorCode::FLOW_CONTROL_ERROR,
            "DATA past the stream's window",
        ))
    }

    /// Takes a DATA frame of `flow_len` bytes (`data_len` of them data, the rest padding) on
    /// `stream`, once counted against the connection's window ([`Flow::received`]): `stream`
    /// is the side's own refusal of it, if any. Refused by the side, by the stream's window or
    /// by its `content-length`, the frame is a stream error and the bytes nobody takes go back
    /// to the connection's window; taken, its padding goes back and the stream's end is noted.
    pub fn take_data(
        &mut self,
        out: &mut Vec<u8>,
        stream: u32,
        receiving: Result<Receiving<'_>, H2Error>,
        flow_len: u32,
        data_len: usize,
        end_stream: bool,
    ) -> Result<(), H2Error> {
        let refused = match receiving {
            Err(e) => Err(e),
            Ok(s) => match Flow::stream_received(s.windows, stream, flow_len) {
                Some(e) => Err(e),
                None => Ok(s),
            },
        };
        let s = match refused {
            Ok(s) => s,
            Err(e) => {
                // Nobody takes these bytes: the connection's window has them back.
                self.give_back(out, 0, None, flow_len as usize);
                return Err(e);
            }
        };
        // Padding is not the caller's to give back.
        let padding = flow_len as usize - data_len;
        if padding > 0 {
            self.give_back(
                out,
                stream,
                Some((&mut *s.windows, *s.remote_ended)),
                padding,
            );
        }
        *s.remote_ended = end_stream;
        // A body longer or shorter than its content-length is malformed.
        if let Some(why) = body_arrived(s.body_left, data_len, end_stream) {
            // Nobody takes these bytes either.
            self.give_back(out, 0, None, data_len);
            return Err(H2Error::Stream(stream, ErrorCode::PROTOCOL_ERROR, why));
        }
        Ok(())
    }

    /// How many bytes may go on a stream with windows `w` now.
    pub fn room(&self, w: &Windows) -> usize {
        w.send.min(self.send).max(0) as usize
    }

    /// `n` bytes went on a stream with windows `w`.
    pub fn sent(&mut self, w: &mut Windows, n: usize) {
        w.send -= n as i64;
        self.send -= n as i64;
    }

    /// `n` bytes of `stream` handled or dropped (`w`: its windows while it is open, and
    /// whether the peer ended its side): a WINDOW_UPDATE goes to `out` once half of a window
    /// waits to be given back (the stream's only while its body goes on), never past the window
    /// this side gave (a caller giving back more than it got is not believed).
    pub fn give_back(
        &mut self,
        out: &mut Vec<u8>,
        stream: u32,
        w: Option<(&mut Windows, bool)>,
        n: usize,
    ) {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        if let Some((w, remote_ended)) = w {
            w.unacked = w.unacked.saturating_add(n);
            if !remote_ended && w.unacked >= self.stream_window / 2 {
                let inc = i64::from(w.unacked).min(i64::from(self.stream_window) - w.recv);
                if inc > 0 {
                    write_window_update(out, stream, inc as u32);
                    w.recv += inc;
                }
                w.unacked = 0;
            }
        }
        self.unacked = self.unacked.saturating_add(n);
        if self.unacked >= self.connection_window / 2 {
            let window = i64::from(self.connection_window.max(DEFAULT_WINDOW));
            let inc = i64::from(self.unacked).min(window - self.recv);
            if inc > 0 {
                write_window_update(out, 0, inc as u32);
                self.recv += inc;
            }
            self.unacked = 0;
        }
    }
}

/// `len` bytes of a body whose `content-length` left `left` bytes to come (if it gave one)
/// arrived, the last ones when `end_stream`: why the body is malformed (longer or shorter than
/// its `content-length`), if it is.
pub fn body_arrived(left: &mut Option<u64>, len: usize, end_stream: bool) -> Option<&'static str> {
    let l = left.as_mut()?;
    match l.checked_sub(len as u64) {
        None => Some("DATA past the content-length"),
        Some(rest) if end_stream && rest > 0 => Some("a body shorter than its content-length"),
        Some(rest) => {
            *l = rest;
            None
        }
    }
}

/// A field block coming across CONTINUATION frames is refused past four times the largest
/// header list taken: a bound on what is held before it is decoded.
pub fn check_block_size(len: usize, max_header_list_size: u32) -> Result<(), H2Error> {
    if len as u64 > 4 * u64::from(max_header_list_size) {
        return Err(H2Error::Connection(
            ErrorCode::ENHANCE_YOUR_CALM,
            "a field block past the header list's size",
        ));
    }
    Ok(())
}

/// A DATA frame's stream as a side holds it (`held`, none when it has no such stream open):
/// refused as `STREAM_CLOSED` when there is none, or when the peer already ended its half
/// (`after_end`, the side's words for that); the side's own refusals come before.
pub fn open_for_data<'a>(
    stream: u32,
    held: Option<Receiving<'a>>,
    after_end: &'static str,
) -> Result<Receiving<'a>, H2Error> {
    match held {
        None => Err(H2Error::Stream(
            stream,
            ErrorCode::STREAM_CLOSED,
            "DATA on a closed stream",
        )),
        Some(s) if *s.remote_ended => {
            Err(H2Error::Stream(stream, ErrorCode::STREAM_CLOSED, after_end))
        }
        Some(s) => Ok(s),
    }
}

/// Where `data`, a slice of `buf` from `payload_at` on, stands in `buf`.
pub fn range_in(buf: &[u8], payload_at: usize, data: &[u8]) -> std::ops::Range<usize> {
    let start = payload_at + (data.as_ptr().addr() - buf[payload_at..].as_ptr().addr());
    start..start + data.len()
}

/// Whether a field is connection-specific, which HTTP/2 forbids (RFC 9113 8.2.2): `te` is
/// allowed only as `trailers` (the one exception the RFC makes, in requests).
pub fn connection_specific(name: &[u8], value: &[u8]) -> bool {
    matches!(
        name,
        b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding" | b"upgrade"
    ) || (name == b"te" && value != b"trailers")
}

/// A side of a connection as [`read_frames`] drives it.
pub(crate) trait Reader {
    type Event;
    /// A HEADERS' field block is being read across CONTINUATION frames.
    fn continuing(&self) -> bool;
    /// Takes one whole frame, whose payload starts at `payload_at` in `buf`.
    fn frame(
        &mut self,
        frame: Frame<'_>,
        buf: &[u8],
        payload_at: usize,
        events: &mut Vec<Self::Event>,
    ) -> Result<(), H2Error>;
    /// Resets the stream of a stream error (and returns `Ok`), or fails the connection.
    fn stream_error(&mut self, e: H2Error, events: &mut Vec<Self::Event>) -> Result<(), H2Error>;
    /// Fails the connection (its GOAWAY written once) and returns `e`.
    fn fail(&mut self, e: H2Error) -> H2Error;
}

/// Reads the whole frames of `buf` from `at` on into `side` and returns how far it read (the
/// rest is an incomplete frame). A frame with a stream error is skipped once its stream is
/// reset; a connection error is returned.
pub(crate) fn read_frames<R: Reader>(
    side: &mut R,
    buf: &[u8],
    mut at: usize,
    events: &mut Vec<R::Event>,
) -> Result<usize, H2Error> {
    loop {
        let (frame, payload_at) = match read(&buf[at..], DEFAULT_MAX_FRAME_SIZE) {
            Ok(Some((frame, used))) => {
                let start = at;
                at += used;
                (frame, start + HEAD_LEN)
            }
            Ok(None) => return Ok(at),
            // Nothing may come between a HEADERS and its CONTINUATIONs, a broken frame least.
            Err(_) if side.continuing() => {
                return Err(side.fail(H2Error::Connection(
                    ErrorCode::PROTOCOL_ERROR,
                    "a field block cut by another frame",
                )));
            }
            Err(e) => {
                side.stream_error(e, events)?;
                // A stream error on a whole frame: skip it.
                let head = Head::read(&buf[at..]).expect("the frame's head was read");
                at += HEAD_LEN + head.len as usize;
                continue;
            }
        };
        if let Err(e) = side.frame(frame, buf, payload_at, events) {
            side.stream_error(e, events)?;
        }
    }
}

/// A peer's SETTINGS (not an ack): applied to `peer`, every stream's send window (`streams`)
/// moved with the initial window, acknowledged in `out`. Returns whether the windows grew.
pub fn take_settings<'a>(
    peer: &mut Settings,
    entries: &[u8],
    streams: impl Iterator<Item = &'a mut Windows>,
    out: &mut Vec<u8>,
) -> Result<bool, H2Error> {
    let before = peer.initial_window_size;
    peer.apply(entries)?;
    let grew = Flow::initial_window_moved(before, peer.initial_window_size, streams)?;
    write_settings_ack(out);
    Ok(grew)
}

/// The streams one side reset lately, the oldest forgotten past [`RecentResets::KEPT`]: frames
/// the peer sent on them before it knew are ignored rather than taken as errors (RFC 9113
/// 5.4.2).
#[derive(Debug, Default)]
pub struct RecentResets {
    order: std::collections::VecDeque<u32>,
    set: std::collections::HashSet<u32>,
}

impl RecentResets {
    /// How many are remembered.
    pub const KEPT: usize = 1_024;

    pub fn remember(&mut self, stream: u32) {
        if self.set.insert(stream) {
            self.order.push_back(stream);
            if self.order.len() > Self::KEPT
                && let Some(old) = self.order.pop_front()
            {
                self.set.remove(&old);
            }
        }
    }

    pub fn contains(&self, stream: u32) -> bool {
        self.set.contains(&stream)
    }
}

/// Writes the head of a DATA frame of `len` bytes (at most the peer's max frame size), the
/// data to follow it.
pub fn write_data_head(out: &mut Vec<u8>, stream: u32, len: usize, end_stream: bool) {
    let flags = if end_stream { flag::END_STREAM } else { 0 };
    write_head(out, len, kind::DATA, flags, stream);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_head(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out
    }

    fn one(bytes: &[u8]) -> Result<Frame<'_>, H2Error> {
        let (f, used) = read(bytes, DEFAULT_MAX_FRAME_SIZE)?.expect("a whole frame");
        assert_eq!(used, bytes.len());
        Ok(f)
    }

    fn conn_err(bytes: &[u8]) -> ErrorCode {
        match one(bytes) {
            Err(H2Error::Connection(c, _)) => c,
            other => panic!("not a connection error: {other:?}"),
        }
    }

    #[test]
    fn a_frame_is_read_once_all_of_it_is_there_and_takes_just_its_bytes() {
        let mut bytes = frame(kind::DATA, flag::END_STREAM, 1, b"hello");
        bytes.extend_from_slice(&frame(kind::PING, 0, 0, &[7; 8]));
        for cut in 0..14 {
            assert_eq!(
                read(&bytes[..cut], DEFAULT_MAX_FRAME_SIZE),
                Ok(None),
                "{cut}"
            );
        }
        let (f, used) = read(&bytes, DEFAULT_MAX_FRAME_SIZE).unwrap().unwrap();
        assert_eq!(
            f,
            Frame::Data {
                stream: 1,
                end_stream: true,
                data: b"hello",
                flow_len: 5
            }
        );
        assert_eq!(used, 14);
        let (f, _) = read(&bytes[used..], DEFAULT_MAX_FRAME_SIZE)
            .unwrap()
            .unwrap();
        assert_eq!(
            f,
            Frame::Ping {
                ack: false,
                payload: [7; 8]
            }
        );
    }

    #[test]
    fn a_frame_larger_than_allowed_is_refused_from_its_head() {
        let mut head = Vec::new();
        write_head(&mut head, 16_385, kind::DATA, 0, 1);
        // The head alone: no need to wait for 16 KiB to refuse it.
        assert_eq!(
            read(&head, DEFAULT_MAX_FRAME_SIZE).unwrap_err().code(),
            ErrorCode::FRAME_SIZE_ERROR
        );
        assert_eq!(
            read(&head, 16_385),
            Ok(None),
            "allowed once the setting says so"
        );
    }

    #[test]
    fn the_reserved_bit_is_ignored() {
        let mut bytes = frame(kind::WINDOW_UPDATE, 0, 3, &(0x8000_0010u32).to_be_bytes());
        bytes[5] |= 0x80;
        assert_eq!(
            one(&bytes).unwrap(),
            Frame::WindowUpdate {
                stream: 3,
                increment: 16
            }
        );
    }

    #[test]
    fn padding_is_taken_off_and_counted_for_flow_control() {
        let mut payload = vec![3];
        payload.extend_from_slice(b"abc");
        payload.extend_from_slice(&[0; 3]);
        let bytes = frame(kind::DATA, flag::PADDED, 1, &payload);
        let f = one(&bytes).unwrap();
        assert_eq!(
            f,
            Frame::Data {
                stream: 1,
                end_stream: false,
                data: b"abc",
                flow_len: 7
            }
        );
        // All but the pad length's byte may be padding; as long as the payload or longer, a
        // connection error.
        assert!(matches!(
            one(&frame(kind::DATA, flag::PADDED, 1, &[3, 0, 0, 0])),
            Ok(Frame::Data {
                data: b"",
                flow_len: 4,
                ..
            })
        ));
        assert_eq!(
            conn_err(&frame(kind::DATA, flag::PADDED, 1, &[4, 0, 0, 0])),
            ErrorCode::PROTOCOL_ERROR
        );
        assert_eq!(
            conn_err(&frame(kind::HEADERS, flag::PADDED, 1, &[1])),
            ErrorCode::PROTOCOL_ERROR
        );
        assert_eq!(
            conn_err(&frame(kind::DATA, flag::PADDED, 1, &[])),
            ErrorCode::FRAME_SIZE_ERROR
        );
    }

    #[test]
    fn headers_give_their_block_without_padding_and_priority() {
        let mut payload = vec![2, 0x80, 0, 0, 1, 15];
        payload.extend_from_slice(b"block");
        payload.extend_from_slice(&[0, 0]);
        let bytes = frame(
            kind::HEADERS,
            flag::PADDED | flag::PRIORITY | flag::END_HEADERS | flag::END_STREAM,
            3,
            &payload,
        );
        let f = one(&bytes).unwrap();
        assert_eq!(
            f,
            Frame::Headers {
                stream: 3,
                end_stream: true,
                end_headers: true,
                priority: Some(Priority {
                    exclusive: true,
                    depends_on: 1,
                    weight: 15
                }),
                block: b"block"
            }
        );
        // A stream depending on itself: read, for the reader to decode its block first and
        // then refuse it.
        assert!(matches!(
            one(&frame(kind::HEADERS, flag::PRIORITY, 3, &[0, 0, 0, 3, 0])),
            Ok(Frame::Headers {
                priority: Some(Priority { depends_on: 3, .. }),
                ..
            })
        ));
        assert_eq!(
            conn_err(&frame(kind::HEADERS, flag::PRIORITY, 3, &[0, 0, 0])),
            ErrorCode::FRAME_SIZE_ERROR
        );
    }

    #[test]
    fn each_type_keeps_to_its_stream_and_its_length() {
        // Stream 0 where a stream is needed, a stream where the connection is.
        for k in [
            kind::DATA,
            kind::HEADERS,
            kind::PRIORITY,
            kind::RST_STREAM,
            kind::PUSH_PROMISE,
            kind::CONTINUATION,
        ] {
            assert_eq!(
                conn_err(&frame(k, 0, 0, &[0; 5])),
                ErrorCode::PROTOCOL_ERROR,
                "{k}"
            );
        }
        for (k, len) in [(kind::SETTINGS, 0), (kind::PING, 8), (kind::GOAWAY, 8)] {
            assert_eq!(
                conn_err(&frame(k, 0, 1, &vec![0; len])),
                ErrorCode::PROTOCOL_ERROR,
                "{k}"
            );
        }
        // Fixed lengths.
        assert_eq!(
            one(&frame(kind::PRIORITY, 0, 1, &[0; 4])).unwrap_err(),
            H2Error::Stream(1, ErrorCode::FRAME_SIZE_ERROR, "PRIORITY not 5 bytes long")
        );
        for (k, stream, len) in [
            (kind::RST_STREAM, 1, 3),
            (kind::PING, 0, 9),
            (kind::GOAWAY, 0, 7),
            (kind::WINDOW_UPDATE, 0, 5),
            (kind::WINDOW_UPDATE, 1, 3),
            (kind::SETTINGS, 0, 5),
        ] {
            assert_eq!(
                conn_err(&frame(k, 0, stream, &vec![0; len])),
                ErrorCode::FRAME_SIZE_ERROR,
                "{k} of {len}"
            );
        }
        assert_eq!(
            conn_err(&frame(kind::SETTINGS, flag::ACK, 0, &[0; 6])),
            ErrorCode::FRAME_SIZE_ERROR
        );
        // A WINDOW_UPDATE of 0: on a stream, that stream's error.
        assert_eq!(
            conn_err(&frame(kind::WINDOW_UPDATE, 0, 0, &[0; 4])),
            ErrorCode::PROTOCOL_ERROR
        );
        assert!(matches!(
            one(&frame(kind::WINDOW_UPDATE, 0, 5, &[0; 4])),
            Err(H2Error::Stream(5, ErrorCode::PROTOCOL_ERROR, _))
        ));
        // An unknown type is read and left to be ignored.
        assert_eq!(
            one(&frame(0xfa, 0xff, 9, b"whatever")).unwrap(),
            Frame::Unknown {
                kind: 0xfa,
                stream: 9
            }
        );
    }

    #[test]
    fn settings_take_their_values_and_refuse_those_out_of_range() {
        let mut out = Vec::new();
        write_settings(
            &mut out,
            &[
                (setting::MAX_CONCURRENT_STREAMS, 100),
                (setting::INITIAL_WINDOW_SIZE, 1 << 20),
                (0x99, 7),
                (setting::ENABLE_PUSH, 0),
                (setting::MAX_FRAME_SIZE, 1 << 20),
                (setting::MAX_HEADER_LIST_SIZE, 8192),
                (setting::HEADER_TABLE_SIZE, 0),
            ],
        );
        let Frame::Settings {
            ack: false,
            entries,
        } = one(&out).unwrap()
        else {
            panic!("not settings");
        };
        let mut s = Settings::default();
        s.apply(entries).unwrap();
        assert_eq!(
            s,
            Settings {
                header_table_size: 0,
                enable_push: false,
                max_concurrent_streams: Some(100),
                initial_window_size: 1 << 20,
                max_frame_size: 1 << 20,
                max_header_list_size: Some(8192),
            }
        );
        for (id, value, code) in [
            (setting::ENABLE_PUSH, 2, ErrorCode::PROTOCOL_ERROR),
            (
                setting::INITIAL_WINDOW_SIZE,
                1 << 31,
                ErrorCode::FLOW_CONTROL_ERROR,
            ),
            (setting::MAX_FRAME_SIZE, 16_383, ErrorCode::PROTOCOL_ERROR),
            (setting::MAX_FRAME_SIZE, 1 << 24, ErrorCode::PROTOCOL_ERROR),
        ] {
            let mut out = Vec::new();
            write_settings(&mut out, &[(id, value)]);
            let Ok(Frame::Settings { entries, .. }) = one(&out) else {
                panic!("not settings");
            };
            let mut s = Settings::default();
            assert_eq!(s.apply(entries).unwrap_err().code(), code, "{id} = {value}");
        }
        let mut ack = Vec::new();
        write_settings_ack(&mut ack);
        assert_eq!(
            one(&ack).unwrap(),
            Frame::Settings {
                ack: true,
                entries: &[]
            }
        );
    }

    #[test]
    fn a_field_block_is_split_into_continuations_by_the_peers_frame_size() {
        let block: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
        let mut out = Vec::new();
        write_headers(&mut out, 5, &block, true, DEFAULT_MAX_FRAME_SIZE);
        let mut at = 0;
        let mut again = Vec::new();
        let mut frames = Vec::new();
        while let Some((f, used)) = read(&out[at..], DEFAULT_MAX_FRAME_SIZE).unwrap() {
            at += used;
            match f {
                Frame::Headers {
                    stream: 5,
                    end_stream: true,
                    end_headers,
                    block,
                    ..
                } => {
                    again.extend_from_slice(block);
                    frames.push(("headers", end_headers));
                }
                Frame::Continuation {
                    stream: 5,
                    end_headers,
                    block,
                } => {
                    again.extend_from_slice(block);
                    frames.push(("continuation", end_headers));
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(at, out.len());
        assert_eq!(again, block);
        assert_eq!(
            frames,
            [
                ("headers", false),
                ("continuation", false),
                ("continuation", true)
            ]
        );
        // A small block: one HEADERS, ended.
        let mut out = Vec::new();
        write_headers(&mut out, 7, b"\x82", false, DEFAULT_MAX_FRAME_SIZE);
        assert_eq!(
            one(&out).unwrap(),
            Frame::Headers {
                stream: 7,
                end_stream: false,
                end_headers: true,
                priority: None,
                block: b"\x82"
            }
        );
    }

    #[test]
    fn control_frames_read_back_as_written() {
        let mut out = Vec::new();
        write_ping(&mut out, true, *b"12345678");
        assert_eq!(
            one(&out).unwrap(),
            Frame::Ping {
                ack: true,
                payload: *b"12345678"
            }
        );
        let mut out = Vec::new();
        write_goaway(
            &mut out,
            7,
            ErrorCode::ENHANCE_YOUR_CALM,
            b"too many resets",
        );
        assert_eq!(
            one(&out).unwrap(),
            Frame::GoAway {
                last_stream: 7,
                code: ErrorCode::ENHANCE_YOUR_CALM,
                debug: b"too many resets"
            }
        );
        let mut out = Vec::new();
        write_rst_stream(&mut out, 9, ErrorCode::CANCEL);
        assert_eq!(
            one(&out).unwrap(),
            Frame::RstStream {
                stream: 9,
                code: ErrorCode::CANCEL
            }
        );
        let mut out = Vec::new();
        write_window_update(&mut out, 0, MAX_WINDOW);
        assert_eq!(
            one(&out).unwrap(),
            Frame::WindowUpdate {
                stream: 0,
                increment: MAX_WINDOW
            }
        );
        let mut out = Vec::new();
        write_data_head(&mut out, 11, 3, true);
        out.extend_from_slice(b"end");
        assert_eq!(
            one(&out).unwrap(),
            Frame::Data {
                stream: 11,
                end_stream: true,
                data: b"end",
                flow_len: 3
            }
        );
        assert_eq!(
            ErrorCode::FLOW_CONTROL_ERROR.to_string(),
            "FLOW_CONTROL_ERROR (0x3)"
        );
        assert_eq!(ErrorCode(0x77).name(), "UNKNOWN");
    }

    proptest! {
        /// Any bytes: a frame, an error or a wait, never a panic; a frame takes its head and
        /// its length, and its borrowed parts lie within it.
        #[test]
        fn any_bytes_read_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..64), max in 0u32..40) {
            if let Ok(Some((f, used))) = read(&bytes, max) {
                let head = Head::read(&bytes).unwrap();
                prop_assert_eq!(used, HEAD_LEN + head.len as usize);
                prop_assert!(head.len <= max);
                prop_assert_eq!(f.stream(), head.stream);
                if let Frame::Data { data, flow_len, .. } = f {
                    prop_assert!(data.len() <= flow_len as usize);
                    prop_assert_eq!(flow_len, head.len);
                }
            }
        }

        /// A field block of any size reads back whole from its HEADERS and CONTINUATIONs.
        #[test]
        fn any_field_block_reads_back(block in proptest::collection::vec(any::<u8>(), 0..40_000), stream in 1u32..MAX_WINDOW) {
            let mut out = Vec::new();
            write_headers(&mut out, stream, &block, false, DEFAULT_MAX_FRAME_SIZE);
            let (mut at, mut again, mut ended) = (0, Vec::new(), false);
            while let Some((f, used)) = read(&out[at..], DEFAULT_MAX_FRAME_SIZE).unwrap() {
                prop_assert!(!ended, "nothing after END_HEADERS");
                at += used;
                match f {
                    Frame::Headers { block, end_headers, stream: s, .. } if again.is_empty() && at == used => {
                        prop_assert_eq!(s, stream);
                        again.extend_from_slice(block);
                        ended = end_headers;
                    }
                    Frame::Continuation { block, end_headers, stream: s } => {
                        prop_assert_eq!(s, stream);
                        again.extend_from_slice(block);
                        ended = end_headers;
                    }
                    other => prop_assert!(false, "{:?}", other),
                }
            }
            prop_assert!(ended);
            prop_assert_eq!(at, out.len());
            prop_assert_eq!(again, block);
        }
    }

    /// The WINDOW_UPDATEs in `out`, as (stream, increment).
    fn updates(out: &[u8]) -> Vec<(u32, u32)> {
        let mut at = 0;
        let mut found = Vec::new();
        while let Ok(Some((frame, used))) = read(&out[at..], DEFAULT_MAX_FRAME_SIZE) {
            if let Frame::WindowUpdate { stream, increment } = frame {
                found.push((stream, increment));
            }
            at += used;
        }
        found
    }

    #[test]
    fn flow_control_gives_back_at_half_never_past_what_was_given_and_bounds_both_ways() {
        let mut out = Vec::new();
        // A stream window of 100 bytes, a connection window of 1,000 (raised from 65,535: no
        // raise written).
        let mut flow = Flow::new(100, 1_000, &mut out);
        assert!(updates(&out).is_empty());
        let mut w = flow.stream(50);
        // Receiving: each window bounds what the peer may send.
        flow.received(60).unwrap();
        assert!(Flow::stream_received(&mut w, 1, 60).is_none());
        let mut other = flow.stream(50);
        assert!(matches!(
            Flow::stream_received(&mut other, 3, 101),
            Some(H2Error::Stream(3, ErrorCode::FLOW_CONTROL_ERROR, _))
        ));
        // Given back: nothing under half a window, then the stream's and, past half of the
        // connection's, the connection's.
        flow.give_back(&mut out, 1, Some((&mut w, false)), 40);
        assert!(updates(&out).is_empty());
        flow.give_back(&mut out, 1, Some((&mut w, false)), 20);
        assert_eq!(updates(&out), [(1, 60)]);
        out.clear();
        // More than was taken opens no window past the one given: the stream's is whole
        // again, and the connection gets back the 60 bytes it took (its window is the
        // default's 65,535: 1,000 is less).
        flow.give_back(&mut out, 1, Some((&mut w, false)), 500);
        assert_eq!(updates(&out), [(0, 60)]);
        out.clear();
        // A stream the peer ended gets nothing back; the connection still does.
        let mut ended = flow.stream(50);
        flow.give_back(&mut out, 5, Some((&mut ended, true)), 80);
        assert!(
            updates(&out).is_empty(),
            "under half the connection's window"
        );
        // Sending: the smaller window bounds, and both shrink.
        assert_eq!(flow.room(&w), 50);
        flow.sent(&mut w, 50);
        assert_eq!(flow.room(&w), 0);
        assert!(!w.open());
        Flow::stream_update(&mut w, 1, 10).unwrap();
        assert_eq!(flow.room(&w), 10);
        assert!(Flow::stream_update(&mut w, 1, MAX_WINDOW).is_err());
        assert!(flow.connection_update(MAX_WINDOW).is_err());
        // SETTINGS_INITIAL_WINDOW_SIZE moves every stream's send window.
        let mut a = flow.stream(10);
        let mut b = flow.stream(10);
        assert_eq!(
            Flow::initial_window_moved(10, 30, [&mut a, &mut b].into_iter()),
            Ok(true)
        );
        assert_eq!((a.send, b.send), (30, 30));
        assert_eq!(
            Flow::initial_window_moved(30, 0, [&mut a].into_iter()),
            Ok(false)
        );
        assert_eq!(a.send, 0);
        assert!(Flow::initial_window_moved(0, MAX_WINDOW, [&mut a].into_iter()).is_ok());
        assert!(Flow::initial_window_moved(0, 1, [&mut a].into_iter()).is_err());
        // The connection's window bounds what arrives on every stream together.
        let mut tight = Flow::new(100, 100, &mut out);
        tight.received(65_535).unwrap();
        assert!(matches!(
            tight.received(1),
            Err(H2Error::Connection(ErrorCode::FLOW_CONTROL_ERROR, _))
        ));
    }
}
