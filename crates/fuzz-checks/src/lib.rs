//! What the fuzz targets check (`fuzz/`). Each target takes arbitrary bytes, must not panic,
//! and asserts what its parser promises. They live in this crate, on the core and the framing
//! crates alone, so the targets stay one line each and build without RocksDB, librdkafka, the
//! Kubernetes client or an IO runtime; `tests/fuzz_regressions.rs` runs them on stable over the
//! seed corpus and every input a fuzzer once found failing (`fuzz/regressions/TARGET/`).

use std::collections::BTreeMap;
use std::path::Path;

use ebb_core::calls::wire::{
    DequeueBody, EnqueueBody, FinishBody, Format, StartBody, StatesBody, check_runner,
};

/// A target's check.
pub type Check = fn(&[u8]);

/// Every target, by the name of its `fuzz/fuzz_targets/NAME.rs`.
pub const TARGETS: &[(&str, Check)] = &[
    ("event_decode", event_decode),
    ("config", config),
    ("http_request_head", http_request_head),
    ("http_response_head", http_response_head),
    ("chunked", chunked),
    ("h2_frames", h2_frames),
    ("discovery", discovery),
    ("cel", cel),
    ("runner_body", runner_body),
    ("functions_body", functions_body),
    ("annotations", annotations),
];

/// The log's record decoder: bytes give an envelope or an error; what decodes re-encodes to
/// the same envelope.
pub fn event_decode(data: &[u8]) {
    if let Ok(env) = ebb_core::event::decode(data) {
        let again = ebb_core::event::decode(&ebb_core::event::encode(&env))
            .expect("a re-encoded envelope decodes");
        assert_eq!(again, env);
    }
}

/// `ebb.toml`: any text is a config or an error; a config's apps give routes and its meta
/// services were built.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cfg) = ebb_core::config::Config::parse(text, Path::new("fuzz/ebb.toml")) {
        for app in &cfg.apps {
            let route = app.route();
            assert_eq!(route.name, app.name);
        }
        assert_eq!(cfg.meta.len(), cfg.services.len());
    }
}

/// The proxy's HTTP/1.1 request head parser ([`ebb_http::h1::fuzzing::request_head`]).
pub fn http_request_head(data: &[u8]) {
    ebb_http::h1::fuzzing::request_head(data);
}

/// The proxy's HTTP/1.1 response head parser ([`ebb_http::h1::fuzzing::response_head`]).
pub fn http_response_head(data: &[u8]) {
    ebb_http::h1::fuzzing::response_head(data);
}

/// HTTP/2 frames read one after another from any bytes, the first byte choosing the largest
/// frame allowed: each is a frame, an error or a wait for more, never a panic; a frame takes
/// its head and its stated length; a SETTINGS frame's entries apply or are refused; and a
/// control frame written again from what was read reads back the same. Then the server side
/// on the same bytes ([`h2_server`]), and the client side ([`h2_client`]).
pub fn h2_frames(data: &[u8]) {
    use ebb_http::h2::{self, Frame};
    let Some((&size, mut rest)) = data.split_first() else {
        return;
    };
    let max = if size & 1 == 0 {
        h2::DEFAULT_MAX_FRAME_SIZE
    } else {
        u32::from(size)
    };
    while let Ok(Some((frame, used))) = h2::read(rest, max) {
        let head = h2::Head::read(rest).expect("a frame has its head");
        assert_eq!(used, h2::HEAD_LEN + head.len as usize);
        assert!(head.len <= max);
        rest = &rest[used..];
        let mut out = Vec::new();
        match frame {
            Frame::Settings { ack: true, .. } => h2::write_settings_ack(&mut out),
            Frame::Settings {
                ack: false,
                entries,
            } => {
                let _ = h2::Settings::default().apply(entries);
                let entries: Vec<_> = h2::SettingsEntries::new(entries).collect();
                assert_eq!(entries.len() * 6, head.len as usize);
                h2::write_settings(&mut out, &entries);
            }
            Frame::Ping { ack, payload } => h2::write_ping(&mut out, ack, payload),
            Frame::RstStream { stream, code } => h2::write_rst_stream(&mut out, stream, code),
            Frame::GoAway {
                last_stream,
                code,
                debug,
            } => h2::write_goaway(&mut out, last_stream, code, debug),
            Frame::WindowUpdate { stream, increment } => {
                h2::write_window_update(&mut out, stream, increment)
            }
            _ => continue,
        }
        let (again, n) = h2::read(&out, h2::MAX_MAX_FRAME_SIZE)
            .expect("a frame written reads")
            .expect("all of it");
        assert_eq!(again, frame);
        assert_eq!(n, out.len());
    }
    h2_server(size, &data[1..]);
    h2_client(size, &data[1..]);
}

/// Every frame in `out` keeps the rules, and no WINDOW_UPDATE gives more than a window: a
/// stream's `stream_window` bytes, the connection's 65,535 (it starts there and cannot be made
/// smaller).
fn whole_frames(out: &[u8], stream_window: u32) {
    use ebb_http::h2::{self, Frame};
    let mut at = 0;
    while at < out.len() {
        let (frame, n) = h2::read(&out[at..], h2::DEFAULT_MAX_FRAME_SIZE)
            .expect("frames written keep the rules")
            .expect("whole frames");
        if let Frame::WindowUpdate { stream, increment } = frame {
            assert!(increment <= if stream == 0 { 65_535 } else { stream_window });
        }
        at += n;
    }
}

/// The client side of a connection with three requests open (one still sending its body) on
/// the same bytes after a server's SETTINGS, given in pieces of `step` bytes: answers, data and
/// ends or a connection error, never a panic; what it writes is whole frames.
fn h2_client(step: u8, bytes: &[u8]) {
    use ebb_http::h2;
    use ebb_http::h2client::{Client, Config, Event};
    let mut input = Vec::new();
    h2::write_settings(&mut input, &[]);
    input.extend_from_slice(bytes);
    let mut client = Client::new(Config {
        initial_window_size: 100,
        connection_window: 1_000,
        max_header_list_size: 1_000,
    });
    let _ = client.request(b"GET", b"http", b"a", b"/", [], true);
    let _ = client.request(b"HEAD", b"http", b"a", b"/h", [], true);
    let posting = client.request(
        b"POST",
        b"http",
        b"a",
        b"/p",
        [(&b"x"[..], &b"y"[..])],
        false,
    );
    let (mut buf, mut events) = (Vec::new(), Vec::new());
    for piece in input.chunks(usize::from(step).max(1)) {
        buf.extend_from_slice(piece);
        let Ok(used) = client.recv(&buf, &mut events) else {
            assert!(client.failed());
            break;
        };
        assert!(used <= buf.len());
        for e in events.drain(..) {
            match e {
                Event::Data { stream, data, .. } => {
                    assert!(data.end <= buf.len());
                    client.consumed(stream, data.len());
                }
                Event::Writable { .. } => {
                    if let Ok(stream) = posting {
                        let _ = client.send_data(stream, &[b'b'; 300], false);
                    }
                }
                _ => {}
            }
        }
        buf.drain(..used);
    }
    let out = std::mem::take(client.out());
    let preface = h2::PREFACE.len();
    assert_eq!(&out[..preface], h2::PREFACE);
    whole_frames(&out[preface..], 100);
}

/// The server side of a connection on the same bytes after a client's preface, given in
/// pieces of `step` bytes and answered as it goes: requests, data and ends or a connection
/// error, never a panic; what it writes is whole frames.
fn h2_server(step: u8, bytes: &[u8]) {
    use ebb_http::h2;
    use ebb_http::h2server::{Config, Event, Server};
    let mut input = h2::PREFACE.to_vec();
    h2::write_settings(&mut input, &[]);
    input.extend_from_slice(bytes);
    let mut server = Server::new(Config {
        initial_window_size: 100,
        connection_window: 1_000,
        max_concurrent_streams: 4,
        max_header_list_size: 1_000,
    });
    let (mut buf, mut events) = (Vec::new(), Vec::new());
    for piece in input.chunks(usize::from(step).max(1)) {
        buf.extend_from_slice(piece);
        let Ok(used) = server.recv(&buf, &mut events) else {
            assert!(server.failed());
            break;
        };
        assert!(used <= buf.len());
        for e in events.drain(..) {
            match e {
                Event::Request { stream, .. } => {
                    let _ = server.respond(stream, 200, [(&b"x"[..], &b"y"[..])], false);
                    let _ = server.send_data(stream, &[b'a'; 300], true);
                }
                Event::Data { stream, data, .. } => {
                    assert!(data.end <= buf.len());
                    server.consumed(stream, data.len());
                }
                Event::Writable { stream } => {
                    let _ = server.send_data(stream, b"more", true);
                }
                _ => {}
            }
        }
        buf.drain(..used);
    }
    whole_frames(&std::mem::take(server.out()), 100);
}

/// The chunked body scanner: the same bytes give the same answer whether they come at once or
/// cut anywhere (the first byte says where), and it never claims more bytes than it was given.
pub fn chunked(data: &[u8]) {
    use ebb_http::chunked::Chunked;
    let Some((&cut, body)) = data.split_first() else {
        return;
    };
    let whole = {
        let mut c = Chunked::new();
        c.advance(body).map(|n| (n, c.is_done()))
    };
    if let Ok((n, done)) = whole {
        assert!(n <= body.len());
        assert!(
            done || n == body.len(),
            "an unfinished body takes every byte"
        );
    }
    let step = usize::from(cut).max(1);
    let mut c = Chunked::new();
    let mut taken = 0;
    let mut pieces = Ok(());
    for piece in body.chunks(step) {
        match c.advance(piece) {
            Ok(n) => {
                assert!(n <= piece.len());
                taken += n;
                if c.is_done() {
                    break;
                }
            }
            Err(e) => {
                pieces = Err(e);
                break;
            }
        }
    }
    match (whole, pieces) {
        (Ok((n, done)), Ok(())) => {
            assert_eq!(n, taken, "the same bytes belong to the body");
            assert_eq!(done, c.is_done());
        }
        (Err(_), Err(_)) => {}
        (w, p) => panic!("at once: {w:?}; in pieces of {step}: {p:?}"),
    }
}

/// Service ids and meta services' path patterns: text is an id or an error, an id's text
/// parses back to the same id; a pattern matches paths without panicking.
pub fn discovery(data: &[u8]) {
    use ebb_core::discovery::id::ServiceId;
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (first, rest) = text.split_once('\n').unwrap_or((text, "/"));
    for id in [ServiceId::parse(first), ServiceId::parse_address(first)]
        .into_iter()
        .flatten()
    {
        let again = ServiceId::parse(&id.to_string())
            .unwrap_or_else(|e| panic!("{id} does not parse again: {e}"));
        assert_eq!(again, id);
        if id.scheme() == "k8s" {
            let _ = ebb_core::discovery::k8s::check(&id);
        }
    }
    if let Ok(p) = ebb_core::discovery::meta::PathPattern::parse(first)
        && let Some(caps) = p.matches(rest)
    {
        let names = p.names();
        for (name, _) in &caps {
            assert!(names.contains(&name.as_str()), "{name} is the pattern's");
        }
    }
    let _ = ebb_core::discovery::parse_load(data);
}

/// CEL: a condition (the text before the first NUL) over an object (JSON after it) compiles or
/// gives an error, and its evaluation under small bounds gives an answer or an error.
pub fn cel(data: &[u8]) {
    use ebb_core::cleaner::cel::{Conditions, Limits};
    let (source, object) = match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b"{}"[..]),
    };
    let Ok(source) = std::str::from_utf8(source) else {
        return;
    };
    let Ok(conditions) = Conditions::compile(&[source.to_owned()], &["object"]) else {
        return;
    };
    let object: serde_json::Value =
        serde_json::from_slice(object).unwrap_or(serde_json::Value::Null);
    let mut bound = conditions.bind(&[("object", &object)]);
    let limits = Limits {
        max_steps: 10_000,
        max_time_ms: 1_000,
    };
    if let Ok(results) = bound.evaluate(1_800_000_000_000, limits) {
        assert_eq!(results.len(), 1);
    }
}

/// The fuzz target's check of the runner API's bodies (`fuzz/`): any bytes give each body or a
/// reason in either format (JSON, MessagePack), never a panic; a call's payload that passes its
/// checks makes a request a runner can send.
pub fn runner_body(bytes: &[u8]) {
    for format in [Format::Json, Format::Msgpack] {
        runner_body_in(bytes, format);
    }
}

fn runner_body_in(bytes: &[u8], format: Format) {
    if let Ok(b) = EnqueueBody::read(bytes, format) {
        let calls = match b {
            EnqueueBody::Batch { calls } => calls,
            EnqueueBody::One(c) => vec![c],
        };
        for c in calls {
            if let Some(id) = &c.id {
                let _ = ebb_core::ids::parse_id(id);
            }
            if let Ok(p) = ebb_core::calls::payload(c.payload.unwrap_or_default(), 1 << 20) {
                let method = http::Method::from_bytes(p.method.as_bytes());
                assert!(method.is_ok(), "method {:?} passed its check", p.method);
                let uri = format!("http://fuzz.test{}", p.path).parse::<http::Uri>();
                assert!(uri.is_ok(), "path {:?} passed its check: {uri:?}", p.path);
            }
        }
    }
    if let Ok(b) = format.decode::<DequeueBody>(bytes) {
        let _ = check_runner(&b.runner);
    }
    if let Ok(b) = format.decode::<StartBody>(bytes) {
        let _ = check_runner(&b.runner);
        for id in b.id.iter().chain(b.ids.iter().flatten()) {
            let _ = ebb_core::ids::parse_id(id);
        }
    }
    if let Ok(b) = FinishBody::read(bytes, format) {
        let items = match b {
            FinishBody::Batch { calls, .. } => calls,
            FinishBody::One { call, .. } => vec![call],
        };
        for f in items {
            let _ = f.finish();
        }
    }
    let _ = format.decode::<StatesBody>(bytes);
}

/// The functions API's template bodies: JSON is a template or an error, and a template that
/// passes gives a spec or a reason.
pub fn functions_body(data: &[u8]) {
    if let Ok(t) = ebb_core::functions::TemplateJson::from_body(data) {
        let _ = t.into_spec();
    }
}

/// Kubernetes Service annotations (`name=value` lines): a route and its workload, nothing, or
/// an error naming the annotation; a route has its Service's name and a domain.
pub fn annotations(data: &[u8]) {
    use ebb_core::orchestrator::annotations::{RouteDefaults, parse_duration_ms, route};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let map: BTreeMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    for v in map.values() {
        let _ = parse_duration_ms(v);
    }
    if let Ok(Some((spec, _workload))) = route("ns", "svc", &map, &RouteDefaults::default()) {
        assert!(spec.max_replicas >= spec.min_replicas);
    }
}
