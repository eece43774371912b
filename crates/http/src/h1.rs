//! HTTP/1.1 heads as ebb's fast path reads and rewrites them, on `httparse` alone.
//!
//! * [`parse_request`] parses a client's request head and, for a request the fast path serves,
//!   writes the backend's head: routed by [`target`](crate::head::target) (one valid `Host`, or
//!   400; an absolute-form target's authority wins and the backend gets the origin form with it as
//!   `Host`), hop-by-hop headers (and those named in `Connection`) dropped, `X-Request-Id` kept
//!   or made, `X-Forwarded-For`, `-Proto`, `-Host` and `Forwarded` added. A head that does not
//!   parse, or whose body cannot be delimited (conflicting `Content-Length`s, a last transfer
//!   coding other than chunked), is refused; with both `Transfer-Encoding: chunked` and
//!   `Content-Length`, the coding frames the body and the length is not forwarded (RFC 9112
//!   section 6.1). Anything else (h2c, HTTP/1.0, upgrades, other codings) is
//!   [`Parsed::Elsewhere`]: the general path's.
//! * [`parse_response`] does the same for a backend's response head.
//!
//! The routes are the caller's ([`Routes`]): the proxy's table, or one route in the fuzz checks.

use std::net::SocketAddr;

use ebb_core::discovery::meta::Changes;
use ebb_core::event::RouteSpec;
use ebb_core::limits::Limit;
use http::StatusCode;

/// Headers parsed in one head (a request's are bounded further by `--max-headers`).
pub const MAX_HEADERS: usize = ebb_core::limits::MAX_HEADERS_CEILING;

/// `Connection` tokens read from one head; more go to the general path.
pub const MAX_CONNECTION_TOKENS: usize = 16;

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    Empty,
    /// `Content-Length` bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Everything until the sender closes (responses only).
    Close,
}

/// A request head, parsed and rewritten for the backend.
pub struct Request<R> {
    pub head_len: usize,
    /// The route it goes to.
    pub entry: R,
    pub body: Framing,
    pub is_head: bool,
    /// GET, HEAD, OPTIONS, TRACE, PUT or DELETE (RFC 9110 section 9.2.2): safe to send again.
    pub idempotent: bool,
    /// The client asked to close after this request.
    pub close: bool,
    /// Its hash key, when its route's policy hashes on something of the request.
    pub key: Option<u64>,
    /// Where its id (`X-Request-Id`, the client's or one made here) is in the backend head.
    pub id: std::ops::Range<usize>,
    /// A browser's page load, which gets the route's waiting page while it wakes.
    pub wants_page: bool,
}

/// What a request head is to the fast path.
pub enum Parsed<R> {
    /// More bytes are needed.
    Partial,
    /// Not a request for this path: the general path serves the connection from here on.
    Elsewhere,
    /// A request to a route; its backend head is in the output buffer.
    Request(Request<R>),
    /// A request answered here (bad or unknown Host); `close` when its body is not read.
    Refuse {
        head_len: usize,
        refusal: Refused,
        close: bool,
    },
}

/// A request the fast path answers itself: its status, its error code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl Refused {
    pub fn new(status: StatusCode, code: &'static str, message: String) -> Self {
        Self {
            status,
            code,
            message,
        }
    }
}

/// A response head, parsed and rewritten for the client into the output buffer.
pub struct Response {
    pub head_len: usize,
    /// The status code.
    pub status: u16,
    /// The load factor it reported (`X-Runner-Load`).
    pub load: Option<f64>,
    pub interim: bool,
    pub body: Framing,
    pub backend_keep_alive: bool,
}

/// The names `Connection` lists (and whether it says `close` or `upgrade`).
pub struct ConnectionTokens<'a> {
    pub names: [&'a [u8]; MAX_CONNECTION_TOKENS],
    pub len: usize,
    pub close: bool,
    pub keep_alive: bool,
    pub upgrade: bool,
    pub overflow: bool,
}

impl<'a> ConnectionTokens<'a> {
    pub fn read(headers: &[httparse::Header<'a>]) -> Self {
        let mut t = ConnectionTokens {
            names: [&[]; MAX_CONNECTION_TOKENS],
            len: 0,
            close: false,
            keep_alive: false,
            upgrade: false,
            overflow: false,
        };
        for h in headers {
            if !h.name.eq_ignore_ascii_case("connection") {
                continue;
            }
            for token in h.value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.is_empty() {
                    continue;
                }
                if token.eq_ignore_ascii_case(b"close") {
                    t.close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    t.keep_alive = true;
                } else if token.eq_ignore_ascii_case(b"upgrade") {
                    t.upgrade = true;
                } else if t.len < MAX_CONNECTION_TOKENS {
                    t.names[t.len] = token;
                    t.len += 1;
                } else {
                    t.overflow = true;
                }
            }
        }
        t
    }

    pub fn names(&self, name: &str) -> bool {
        self.names[..self.len]
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name.as_bytes()))
    }
}

/// Headers that belong to one connection (RFC 9110 section 7.6.1, and the old
/// `Proxy-Connection`), never forwarded as they are.
pub fn hop_by_hop(name: &str) -> bool {
    const NAMES: [&str; 9] = [
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    NAMES.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// What a head refused for a line ending in LF alone is told.
pub const LONE_LF: &str = "a line of the request head ends in LF without CR";

/// Whether a head has a line ending in LF alone.
pub fn bare_lf(head: &[u8]) -> bool {
    let mut prev = 0u8;
    for &b in head {
        if b == b'\n' && prev != b'\r' {
            return true;
        }
        prev = b;
    }
    false
}

/// A request whose body cannot be delimited: 400, and the connection closed.
pub fn bad_framing<R>(head_len: usize, message: &str) -> Parsed<R> {
    Parsed::Refuse {
        head_len,
        refusal: Refused::new(StatusCode::BAD_REQUEST, "bad_framing", message.to_owned()),
        close: true,
    }
}

/// Whether a `Transfer-Encoding` list ends with `chunked`.
pub fn last_coding_is_chunked(te: &[u8]) -> bool {
    te.rsplit(|b| *b == b',')
        .next()
        .is_some_and(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// A `Content-Length` field value: one length, or a list of the same one (RFC 9112 section 6.3
/// lets a recipient take `5, 5` as 5).
pub fn content_lengths(value: &[u8]) -> Option<u64> {
    let mut n = None;
    for v in value.split(|b| *b == b',') {
        let v = content_length(v)?;
        if n.is_some_and(|n| n != v) {
            return None;
        }
        n = Some(v);
    }
    n
}

/// A `Content-Length` value: digits only.
pub fn content_length(value: &[u8]) -> Option<u64> {
    let v = value.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// A request's Host as the meta services see it ([`Routes::service`]).
pub enum ServiceMatch<R> {
    /// No meta service has the Host: the routes are looked at.
    NotAService,
    /// A meta service's Host, and the general path serves the request (no rule matches, or the
    /// rule needs what only that path does).
    Elsewhere,
    /// A request the fast path serves: the route it goes to under the service's matching rule,
    /// and the target sent on (the rule's rewrite).
    Fast(R, String),
}

/// What the head parser asks of the proxy: whether a Host is a meta service's, and its route.
pub trait Routes {
    /// What a request's route is to the caller (the proxy's table entry).
    type Route;
    /// The spec of a route.
    fn spec(route: &Self::Route) -> &RouteSpec;
    fn route(&self, host: &str) -> Option<Self::Route>;
    /// What a meta service makes of a request to its Host (one lookup of the Host answers both
    /// whether it is a service's and the rule's route): see [`ServiceMatch`].
    fn service<'v>(
        &self,
        _host: &str,
        _method: &str,
        _target: &str,
        _header: &dyn Fn(&str) -> Option<&'v [u8]>,
    ) -> ServiceMatch<Self::Route> {
        ServiceMatch::NotAService
    }
    /// A meta service's changes to a request's headers (names in lower case, every one a
    /// header this head writer does not write itself, values valid), and the Host it sends
    /// instead of the request's.
    fn request_changes(_route: &Self::Route) -> (Option<&Changes>, Option<&str>) {
        (None, None)
    }
    fn max_headers(&self) -> usize;
    fn max_head_bytes(&self) -> usize;
    /// Whether requests are traced: the head writer then leaves the request's `traceparent`
    /// and `tracestate` (W3C Trace Context) to [`Routes::trace`] instead of copying them.
    fn traces(&self) -> bool {
        false
    }
    /// A traced request's trace context, as the client sent it (the first of each header):
    /// writes the header lines that carry the context on to `out` (its own span's, or the
    /// client's as they came). `id`: where the request id is in `out`.
    #[allow(clippy::too_many_arguments)]
    fn trace(
        &self,
        _route: &Self::Route,
        _method: &str,
        _host: &str,
        _path: &str,
        _traceparent: Option<&[u8]>,
        _tracestate: Option<&[u8]>,
        _id: std::ops::Range<usize>,
        _out: &mut Vec<u8>,
    ) {
    }
}

/// The client's address as the forwarding headers write it, formatted once per connection.
pub struct Peer {
    /// For `X-Forwarded-For`.
    pub ip: String,
    /// For `Forwarded: for=` (an IPv6 address bracketed and quoted).
    pub node: String,
}

impl Peer {
    pub fn new(addr: SocketAddr) -> Self {
        let ip = addr.ip().to_string();
        let node = if addr.is_ipv6() {
            format!("\"[{ip}]\"")
        } else {
            ip.clone()
        };
        Self { ip, node }
    }
}

/// Parses a request head and, for a request this path serves, writes the backend's head to `out`.
pub fn parse_request<R: Routes>(
    buf: &[u8],
    peer: &Peer,
    proxy: &R,
    out: &mut Vec<u8>,
) -> Parsed<R::Route> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        // Another version: HTTP/2's preface (h2c), or one the general path refuses.
        Err(httparse::Error::Version) => return Parsed::Elsewhere,
        Err(e) => {
            let (status, code) = if e == httparse::Error::TooManyHeaders {
                Limit::Headers.hit();
                (
                    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    "too_many_headers",
                )
            } else {
                (StatusCode::BAD_REQUEST, "bad_request")
            };
            // Where the head ends is unknown: answer and close.
            return Parsed::Refuse {
                head_len: buf.len(),
                refusal: Refused::new(status, code, format!("malformed request head: {e}")),
                close: true,
            };
        }
    };
    let (Some(method), Some(path), Some(1)) = (req.method, req.path, req.version) else {
        return Parsed::Elsewhere;
    };
    if bare_lf(&buf[..head_len]) {
        // httparse takes a lone LF as a line's end; a server behind may not: refused, so that
        // the two can never disagree on where the head ends.
        return Parsed::Refuse {
            head_len,
            refusal: Refused::new(StatusCode::BAD_REQUEST, "bad_request", LONE_LF.to_owned()),
            close: true,
        };
    }
    if head_len > proxy.max_head_bytes() {
        Limit::HeadBytes.hit();
        return Parsed::Refuse {
            head_len,
            refusal: Refused::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "head_too_large",
                format!(
                    "the request head is over {} bytes (--max-head-bytes)",
                    proxy.max_head_bytes()
                ),
            ),
            close: true,
        };
    }
    let headers = &*req.headers;
    if headers.len() > proxy.max_headers() {
        Limit::Headers.hit();
        return Parsed::Refuse {
            head_len,
            refusal: Refused::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "too_many_headers",
                format!(
                    "the request has {} header lines; the bound is {} (--max-headers)",
                    headers.len(),
                    proxy.max_headers()
                ),
            ),
            close: true,
        };
    }
    let conn = ConnectionTokens::read(headers);
    if conn.upgrade || conn.overflow {
        return Parsed::Elsewhere;
    }
    // Every Host line, to refuse a second one (two are enough to tell).
    let mut hosts: [&[u8]; 2] = [&[]; 2];
    let mut host_lines = 0;
    let mut length: Option<u64> = None;
    let mut transfer: Option<&[u8]> = None;
    for h in headers {
        if h.name.eq_ignore_ascii_case("host") {
            if host_lines < hosts.len() {
                hosts[host_lines] = h.value;
                host_lines += 1;
            }
        } else if h.name.eq_ignore_ascii_case("content-length") {
            match (content_lengths(h.value), length) {
                (Some(n), None) => length = Some(n),
                (Some(n), Some(m)) if n == m => {}
                // The body's length cannot be told (RFC 9112 section 6.3): refuse, and close.
                _ => return bad_framing(head_len, "invalid or conflicting Content-Length"),
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if transfer.is_some() {
                return Parsed::Elsewhere;
            }
            transfer = Some(h.value.trim_ascii());
        } else if h.name.eq_ignore_ascii_case("upgrade") {
            return Parsed::Elsewhere;
        }
    }
    let chunked = match transfer {
        None => false,
        Some(te) if te.eq_ignore_ascii_case(b"chunked") => true,
        // Other codings before chunked: the general path passes them on.
        Some(te) if last_coding_is_chunked(te) => return Parsed::Elsewhere,
        Some(_) => return bad_framing(head_len, "the last transfer coding is not chunked"),
    };
    let body = match (chunked, length) {
        (true, _) => Framing::Chunked,
        (false, Some(0) | None) => Framing::Empty,
        (false, Some(n)) => Framing::Length(n),
    };
    let close = conn.close || body != Framing::Empty;
    let target = match crate::head::target(method, path, &hosts[..host_lines], true) {
        Ok(t) => t,
        Err(e) => {
            return Parsed::Refuse {
                head_len,
                refusal: Refused::new(e.status(), e.code(), e.message().to_owned()),
                close: close || e.closes(),
            };
        }
    };
    let host = target.host;
    // A meta service: its matching rule rewrites the head here, or the general path serves the
    // request.
    let header = |n: &str| {
        headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(n))
            .map(|h| h.value)
    };
    let (entry, sent) = match proxy.service(host, method, &target.path, &header) {
        ServiceMatch::Fast(entry, sent) => (entry, Some(sent)),
        ServiceMatch::Elsewhere => return Parsed::Elsewhere,
        ServiceMatch::NotAService => match proxy.route(host) {
            Some(entry) => (entry, None),
            None => {
                let message = format!("no route for host {host:?}");
                return Parsed::Refuse {
                    head_len,
                    refusal: Refused::new(StatusCode::NOT_FOUND, "unknown_host", message),
                    close,
                };
            }
        },
    };
    let (changes, sent_host) = R::request_changes(&entry);

    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(sent.as_deref().unwrap_or(&target.path).as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(sent_host.unwrap_or(host).as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut id = 0..0;
    let traces = proxy.traces();
    let (mut traceparent, mut tracestate) = (None, None);
    for h in headers {
        let name = h.name;
        if traces {
            if name.eq_ignore_ascii_case("traceparent") {
                traceparent = traceparent.or(Some(h.value));
                continue;
            }
            if name.eq_ignore_ascii_case("tracestate") {
                tracestate = tracestate.or(Some(h.value));
                continue;
            }
        }
        // The framing is written below from what was parsed, so `Connection` naming
        // Content-Length cannot take a body's framing away; Host was written above, from the
        // target's authority when it had one.
        if hop_by_hop(name)
            || conn.names(name)
            || name.eq_ignore_ascii_case("host")
            || name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("x-forwarded-for")
            || name.eq_ignore_ascii_case("x-forwarded-proto")
            || name.eq_ignore_ascii_case("x-forwarded-host")
            || name.eq_ignore_ascii_case("forwarded")
        {
            continue;
        }
        if name.eq_ignore_ascii_case(crate::request_id::HEADER) {
            // The first usable one is passed on; others are dropped.
            if id.is_empty() && crate::request_id::usable(h.value) {
                let at = out.len() + name.len() + 2;
                push_header(out, name.as_bytes(), h.value);
                id = at..at + h.value.len();
            }
            continue;
        }
        if changes.is_some_and(|c| c.replaces(name)) {
            continue;
        }
        push_header(out, name.as_bytes(), h.value);
    }
    if let Some(c) = changes {
        c.push_to(out);
    }
    // With both, the transfer coding frames the body and the connection ends after the answer
    // (RFC 9112 section 6.1): Content-Length is not forwarded.
    push_framing(
        out,
        chunked.then_some(b"chunked".as_slice()),
        if chunked { None } else { length },
    );
    if id.is_empty() {
        out.extend_from_slice(b"x-request-id: ");
        let at = out.len();
        out.extend_from_slice(&crate::request_id::make());
        id = at..out.len();
        out.extend_from_slice(b"\r\n");
    }
    if traces {
        let path = sent.as_deref().unwrap_or(&target.path);
        proxy.trace(
            &entry,
            method,
            host,
            path,
            traceparent,
            tracestate,
            id.clone(),
            out,
        );
    }
    // X-Forwarded-For and Forwarded extend what earlier proxies said.
    out.extend_from_slice(b"x-forwarded-for: ");
    for h in headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("x-forwarded-for"))
        .filter(|h| !h.value.trim_ascii().is_empty())
    {
        out.extend_from_slice(h.value.trim_ascii());
        out.extend_from_slice(b", ");
    }
    out.extend_from_slice(peer.ip.as_bytes());
    out.extend_from_slice(b"\r\nx-forwarded-proto: http\r\nx-forwarded-host: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\nforwarded: ");
    for h in headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("forwarded"))
        .filter(|h| !h.value.trim_ascii().is_empty())
    {
        out.extend_from_slice(h.value.trim_ascii());
        out.extend_from_slice(b", ");
    }
    out.extend_from_slice(b"for=");
    out.extend_from_slice(peer.node.as_bytes());
    out.extend_from_slice(b";host=\"");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\";proto=http\r\n\r\n");
    let spec = R::spec(&entry);
    let entry_wants_page = spec.waiting_page.is_some();
    let key = spec.policy.hash_on.as_ref().and_then(|h| {
        let client = peer
            .ip
            .parse()
            .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
        ebb_core::discovery::request_key(
            h,
            &target.path,
            |n| {
                headers
                    .iter()
                    .find(|x| x.name.eq_ignore_ascii_case(n))
                    .map(|x| x.value)
            },
            client,
        )
    });
    Parsed::Request(Request {
        key,
        head_len,
        entry,
        body,
        is_head: method == "HEAD",
        idempotent: matches!(
            method,
            "GET" | "HEAD" | "OPTIONS" | "TRACE" | "PUT" | "DELETE"
        ),
        close: conn.close || (chunked && length.is_some()),
        id,
        wants_page: entry_wants_page
            && ebb_core::waiting::wanted(
                method.as_bytes(),
                headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("accept"))
                    .map(|h| h.value),
            ),
    })
}

/// What a response head says of its message and its connection; both HTTP/1.1 hops to replicas
/// read it ([`parse_response`], and the general path's hop for HTTP/2 clients).
pub struct ResponseHead<'h> {
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub version: u8,
    pub code: u16,
    /// A 1xx answer before the final one.
    pub interim: bool,
    pub conn: ConnectionTokens<'h>,
    /// The `Content-Length`, when the head has one (the same value in every field).
    pub length: Option<u64>,
    /// The `Transfer-Encoding`, when the head has one.
    pub transfer: Option<&'h [u8]>,
    /// The load factor it reported (`X-Runner-Load`).
    pub load: Option<f64>,
    pub body: Framing,
    /// The connection may carry another request after this answer.
    pub keep_alive: bool,
}

/// Parses a response head at the start of `buf` into `fields` and reads it (of an answer to a
/// HEAD request when `is_head`): `Ok(None)` when more bytes are needed, else the head's length,
/// the parsed head and what it says.
///
/// Inlined: its answer is a few hundred bytes, which the fast path's [`parse_response`] would
/// otherwise copy on every response.
#[allow(clippy::type_complexity)]
#[inline(always)]
pub fn parse_response_head<'f, 'b>(
    buf: &'b [u8],
    fields: &'f mut [httparse::Header<'b>],
    is_head: bool,
) -> Result<Option<(usize, httparse::Response<'f, 'b>, ResponseHead<'b>)>, String> {
    let mut resp = httparse::Response::new(fields);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("malformed response head: {e}")),
    };
    let head = read_response(&resp, is_head)?;
    Ok(Some((len, resp, head)))
}

/// Reads a parsed response head: its framing (RFC 9112 section 6.3) and its connection's fate. A
/// 101 is refused: no request a hop sends this way asks for an upgrade.
#[inline(always)]
fn read_response<'h>(
    resp: &httparse::Response<'_, 'h>,
    is_head: bool,
) -> Result<ResponseHead<'h>, String> {
    let (Some(version), Some(code)) = (resp.version, resp.code) else {
        return Err("malformed response head".into());
    };
    if code == 101 {
        return Err("unexpected 101 Switching Protocols".into());
    }
    if !(100..1000).contains(&code) {
        return Err(format!("invalid status code {code}"));
    }
    let interim = (100..200).contains(&code);
    let headers: &[httparse::Header<'h>] = resp.headers;
    let conn = ConnectionTokens::read(headers);
    if conn.overflow {
        return Err("too many Connection tokens in the response".into());
    }
    let mut length: Option<u64> = None;
    let mut transfer: Option<&'h [u8]> = None;
    let mut load = None;
    for h in headers {
        if h.name.eq_ignore_ascii_case("content-length") {
            match (content_length(h.value), length) {
                (Some(n), None) => length = Some(n),
                (Some(n), Some(m)) if n == m => {}
                _ => return Err("invalid Content-Length in the response".into()),
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if transfer.is_some() {
                return Err("more than one Transfer-Encoding in the response".into());
            }
            transfer = Some(h.value.trim_ascii());
        } else if h.name.eq_ignore_ascii_case("x-runner-load") {
            load = ebb_core::discovery::parse_load(h.value);
        }
    }
    let body = if interim || is_head || code == 204 || code == 304 {
        Framing::Empty
    } else if let Some(te) = transfer {
        if last_coding_is_chunked(te) {
            Framing::Chunked
        } else {
            Framing::Close
        }
    } else if let Some(n) = length {
        if n == 0 {
            Framing::Empty
        } else {
            Framing::Length(n)
        }
    } else {
        Framing::Close
    };
    let keep_alive = !conn.close && (version == 1 || conn.keep_alive);
    Ok(ResponseHead {
        version,
        code,
        interim,
        conn,
        length,
        transfer,
        load,
        body,
        keep_alive,
    })
}

/// Parses a response head and writes the client's head to `out`. `Ok(None)`: more bytes needed.
/// `changes`: a meta service's changes to the response's headers (as [`Routes::request_changes`]
/// says of a request's).
pub fn parse_response(
    buf: &[u8],
    out: &mut Vec<u8>,
    is_head: bool,
    client_wants_close: bool,
    changes: Option<&Changes>,
) -> Result<Option<Response>, String> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let Some((head_len, resp, head)) = parse_response_head(buf, &mut fields, is_head)? else {
        return Ok(None);
    };
    let ResponseHead {
        code,
        interim,
        conn,
        length,
        transfer,
        load,
        body,
        keep_alive: backend_keep_alive,
        ..
    } = head;
    let headers = &*resp.headers;
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(&[
        b'0' + (code / 100) as u8,
        b'0' + (code / 10 % 10) as u8,
        b'0' + (code % 10) as u8,
    ]);
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for h in headers {
        let name = h.name;
        if hop_by_hop(name)
            || conn.names(name)
            || name.eq_ignore_ascii_case("content-length")
            || changes.is_some_and(|c| c.replaces(name))
        {
            continue;
        }
        push_header(out, name.as_bytes(), h.value);
    }
    if let Some(c) = changes
        && !interim
    {
        c.push_to(out);
    }
    // The framing as parsed: Transfer-Encoding wins over Content-Length (RFC 9112 section 6.3).
    push_framing(
        out,
        transfer,
        if transfer.is_some() { None } else { length },
    );
    if !interim && (client_wants_close || body == Framing::Close) {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok(Some(Response {
        head_len,
        status: code,
        load,
        interim,
        body,
        backend_keep_alive,
    }))
}

/// A meta service's header changes as a head writer applies them: a header named in `set` or
/// `remove` is not copied, then `set`'s and `add`'s are written (the general path's order:
/// remove, set, add).
trait ApplyChanges {
    fn replaces(&self, name: &str) -> bool;
    fn push_to(&self, out: &mut Vec<u8>);
}

impl ApplyChanges for Changes {
    fn replaces(&self, name: &str) -> bool {
        self.set.iter().any(|(n, _)| n.eq_ignore_ascii_case(name))
            || self.remove.iter().any(|n| n.eq_ignore_ascii_case(name))
    }

    fn push_to(&self, out: &mut Vec<u8>) {
        for (n, v) in self.set.iter().chain(&self.add) {
            push_header(out, n.as_bytes(), v.as_bytes());
        }
    }
}

/// Writes the framing headers of a message.
pub fn push_framing(out: &mut Vec<u8>, transfer: Option<&[u8]>, length: Option<u64>) {
    if let Some(te) = transfer {
        push_header(out, b"transfer-encoding", te);
    }
    if let Some(n) = length {
        out.extend_from_slice(b"content-length: ");
        push_display(out, &n);
        out.extend_from_slice(b"\r\n");
    }
}

pub fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

pub fn push_display(out: &mut Vec<u8>, v: &impl std::fmt::Display) {
    use std::io::Write as _;
    let _ = write!(out, "{v}");
}

/// The fuzz targets' checks of the HTTP/1.1 heads (`fuzz/`, and their regression tests).
pub mod fuzzing {
    use std::sync::Arc;

    use super::*;

    /// One route, on `fuzz.test`, and a meta service on `svc.fuzz.test`.
    struct OneRoute(Arc<RouteSpec>);

    impl Routes for OneRoute {
        type Route = Arc<RouteSpec>;

        fn spec(route: &Arc<RouteSpec>) -> &RouteSpec {
            route
        }

        fn route(&self, host: &str) -> Option<Arc<RouteSpec>> {
            (host == "fuzz.test").then(|| self.0.clone())
        }

        fn service<'v>(
            &self,
            host: &str,
            _: &str,
            _: &str,
            _: &dyn Fn(&str) -> Option<&'v [u8]>,
        ) -> ServiceMatch<Arc<RouteSpec>> {
            if host == "svc.fuzz.test" {
                ServiceMatch::Elsewhere
            } else {
                ServiceMatch::NotAService
            }
        }

        fn max_headers(&self) -> usize {
            MAX_HEADERS
        }

        fn max_head_bytes(&self) -> usize {
            64 * 1024
        }
    }

    /// The headers named `name` in a parsed head.
    fn values<'a>(headers: &'a [httparse::Header<'a>], name: &str) -> Vec<&'a [u8]> {
        headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value)
            .collect()
    }

    /// Parses `data` as a client's request head. Whatever it is, nothing panics; a request
    /// passed on becomes one well-formed HTTP/1.1 head with one Host, one X-Request-Id and one
    /// framing header that says what the parser decided.
    pub fn request_head(data: &[u8]) {
        thread_local! {
            static ROUTES: OneRoute =
                OneRoute(Arc::new(RouteSpec::for_test("fuzz", &["fuzz.test"])));
        }
        let peer = Peer::new(SocketAddr::from(([127, 0, 0, 1], 40_000)));
        let mut out = Vec::new();
        let parsed = ROUTES.with(|r| parse_request(data, &peer, r, &mut out));
        let r = match parsed {
            Parsed::Request(r) => r,
            Parsed::Refuse { head_len, .. } => {
                assert!(
                    head_len <= data.len(),
                    "a refused head ends inside the input"
                );
                return;
            }
            Parsed::Partial | Parsed::Elsewhere => return,
        };
        assert!(r.head_len <= data.len(), "the head ends inside the input");
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS + 16];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&out) {
            Ok(httparse::Status::Complete(n)) => {
                assert_eq!(n, out.len(), "the backend's head is one head")
            }
            other => panic!(
                "the backend's head does not parse ({other:?}): {:?}",
                String::from_utf8_lossy(&out)
            ),
        }
        assert_eq!(req.version, Some(1));
        let headers = &*req.headers;
        assert_eq!(values(headers, "host"), [b"fuzz.test".as_slice()]);
        let ids = values(headers, "x-request-id");
        assert_eq!(ids.len(), 1, "one X-Request-Id");
        assert_eq!(ids[0], &out[r.id.clone()], "the id's place in the head");
        let lengths = values(headers, "content-length");
        let codings = values(headers, "transfer-encoding");
        match r.body {
            Framing::Chunked => {
                assert!(lengths.is_empty(), "chunked without Content-Length");
                assert_eq!(codings, [b"chunked".as_slice()]);
            }
            Framing::Length(n) => {
                assert!(codings.is_empty());
                assert_eq!(lengths, [n.to_string().as_bytes()]);
            }
            Framing::Empty => {
                assert!(codings.is_empty());
                assert!(lengths.is_empty() || lengths == [b"0".as_slice()]);
            }
            Framing::Close => panic!("a request is never framed by the close"),
        }
        for h in [
            "connection",
            "keep-alive",
            "upgrade",
            "te",
            "proxy-connection",
        ] {
            assert!(values(headers, h).is_empty(), "{h} is not passed on");
        }
    }

    /// Parses `data` as a backend's response head, for a GET and for a HEAD: nothing panics, and
    /// a response passed on is one well-formed head with at most one framing header.
    pub fn response_head(data: &[u8]) {
        for is_head in [false, true] {
            let mut out = Vec::new();
            let Ok(Some(resp)) = parse_response(data, &mut out, is_head, false, None) else {
                continue;
            };
            assert!(resp.head_len <= data.len());
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS + 16];
            let mut parsed = httparse::Response::new(&mut headers);
            match parsed.parse(&out) {
                Ok(httparse::Status::Complete(n)) => assert_eq!(n, out.len()),
                other => panic!(
                    "the client's head does not parse ({other:?}): {:?}",
                    String::from_utf8_lossy(&out)
                ),
            }
            assert_eq!(parsed.code, Some(resp.status));
            let headers = &*parsed.headers;
            let framing = values(headers, "content-length").len()
                + values(headers, "transfer-encoding").len();
            assert!(framing <= 1, "one framing header at most");
            if resp.body == Framing::Chunked {
                assert!(values(headers, "content-length").is_empty());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A meta service on `svc.test` whose one rule rewrites `/api/X` to `/v2/X`, sends the Host
    /// `backend.test`, sets `x-from`, adds `x-tag` and removes `x-secret`.
    struct Service;

    impl Routes for Service {
        type Route = ();

        fn spec(_: &()) -> &RouteSpec {
            static SPEC: std::sync::LazyLock<RouteSpec> =
                std::sync::LazyLock::new(RouteSpec::default);
            &SPEC
        }

        fn route(&self, _: &str) -> Option<()> {
            None
        }

        fn service<'v>(
            &self,
            host: &str,
            _: &str,
            target: &str,
            _: &dyn Fn(&str) -> Option<&'v [u8]>,
        ) -> ServiceMatch<()> {
            if host != "svc.test" {
                return ServiceMatch::NotAService;
            }
            match target.strip_prefix("/api/") {
                Some(rest) => ServiceMatch::Fast((), format!("/v2/{rest}")),
                None => ServiceMatch::Elsewhere,
            }
        }

        fn request_changes(_: &()) -> (Option<&Changes>, Option<&str>) {
            static CHANGES: std::sync::LazyLock<Changes> = std::sync::LazyLock::new(|| Changes {
                set: vec![("x-from".into(), "ebb".into())],
                add: vec![("x-tag".into(), "two".into())],
                remove: vec!["x-secret".into()],
            });
            (Some(&CHANGES), Some("backend.test"))
        }

        fn max_headers(&self) -> usize {
            MAX_HEADERS
        }

        fn max_head_bytes(&self) -> usize {
            64 * 1024
        }
    }

    #[test]
    fn a_meta_service_rule_is_applied_by_the_head_writers() {
        let peer = Peer::new(SocketAddr::from(([10, 0, 0, 7], 40_000)));
        let routes = Service;
        let mut out = Vec::new();
        let raw = "GET /api/items?q=1 HTTP/1.1\r\nHost: svc.test\r\nX-From: client\r\nx-tag: one\r\nX-Secret: s\r\nx-request-id: abc\r\n\r\n";
        let Parsed::Request(r) = parse_request(raw.as_bytes(), &peer, &routes, &mut out) else {
            panic!("the rule's request is the fast path's");
        };
        let head = String::from_utf8(out).unwrap();
        assert_eq!(r.head_len, raw.len());
        assert_eq!(&head[r.id.clone()], "abc");
        assert!(
            head.starts_with("GET /v2/items?q=1 HTTP/1.1\r\nhost: backend.test\r\n"),
            "{head}"
        );
        assert!(
            !head.contains("X-From: client") && head.contains("x-from: ebb\r\n"),
            "{head}"
        );
        assert!(
            head.contains("x-tag: one\r\n") && head.contains("x-tag: two\r\n"),
            "{head}"
        );
        assert!(!head.to_ascii_lowercase().contains("x-secret"), "{head}");
        assert!(head.contains("x-forwarded-host: svc.test\r\n"), "{head}");
        // A target the rule does not take: the general path's.
        let mut out = Vec::new();
        let other = "GET /other HTTP/1.1\r\nHost: svc.test\r\n\r\n";
        assert!(matches!(
            parse_request(other.as_bytes(), &peer, &routes, &mut out),
            Parsed::Elsewhere
        ));
        // The answer: `x-secret` removed, `x-from` replaced, `x-tag` added beside the app's.
        let changes = Service::request_changes(&()).0.unwrap();
        let mut out = Vec::new();
        parse_response(
            b"HTTP/1.1 200 OK\r\nx-secret: s\r\nx-from: app\r\nx-tag: one\r\ncontent-length: 0\r\n\r\n",
            &mut out,
            false,
            false,
            Some(changes),
        )
        .unwrap()
        .unwrap();
        let head = String::from_utf8(out).unwrap();
        assert_eq!(
            head,
            "HTTP/1.1 200 OK\r\nx-tag: one\r\nx-from: ebb\r\nx-tag: two\r\ncontent-length: 0\r\n\r\n"
        );
    }

    fn response(raw: &str, is_head: bool) -> (Response, String) {
        let mut out = Vec::new();
        let r = parse_response(raw.as_bytes(), &mut out, is_head, false, None)
            .unwrap()
            .unwrap();
        (r, String::from_utf8(out).unwrap())
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let (r, head) = response(
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: keep-alive, x-private\r\nx-private: 1\r\nkeep-alive: timeout=5\r\n\r\nhello",
            false,
        );
        assert_eq!(r.body, Framing::Length(5));
        assert!(r.backend_keep_alive);
        assert_eq!(head, "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n");
        let (r, _) = response("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", true);
        assert_eq!(r.body, Framing::Empty, "HEAD has no body");
        let (r, head) = response(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n",
            false,
        );
        assert_eq!(r.body, Framing::Chunked);
        assert!(!head.contains("content-length"), "{head}");
        assert!(head.contains("transfer-encoding: chunked"), "{head}");
        let (r, head) = response("HTTP/1.0 200 OK\r\n\r\n", false);
        assert_eq!(r.body, Framing::Close);
        assert!(!r.backend_keep_alive);
        assert!(head.ends_with("connection: close\r\n\r\n"), "{head}");
        let (r, _) = response("HTTP/1.1 204 No Content\r\n\r\n", false);
        assert_eq!(r.body, Framing::Empty);
        let (r, _) = response("HTTP/1.1 100 Continue\r\n\r\n", false);
        assert!(r.interim);
        let mut out = Vec::new();
        for bad in [
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "nonsense\r\n\r\n",
        ] {
            assert!(
                parse_response(bad.as_bytes(), &mut out, false, false, None).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn content_lengths_are_digits_only() {
        assert_eq!(content_length(b" 42 "), Some(42));
        for bad in [&b""[..], b"+1", b"1 2", b"0x10", b"99999999999999999999"] {
            assert_eq!(content_length(bad), None, "{bad:?}");
        }
    }
}
