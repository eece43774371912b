//! gRPC through the general path: a request that came over HTTP/2 (h2c, or h2 when ebb
//! terminates TLS) with a `application/grpc` content type goes on to the replica over h2c, with
//! `te: trailers`, its streams both ways and its trailers untouched. Its `grpc-timeout` bounds the
//! wait for a replica (a wake longer than the call's deadline answers `DEADLINE_EXCEEDED` at the
//! deadline, not later), and what ebb itself refuses is a gRPC status a client understands (a
//! trailers-only answer).
//!
//! The hop to the replica is [`super::h2hop`]'s: h2c connections per replica and proxy thread
//! on ebb's own HTTP/2 client side, a stream per call; `te: trailers` is put back after the
//! hop-by-hop headers are stripped.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Request, Response, StatusCode};

use super::Body;

/// gRPC status codes ebb answers with.
pub const DEADLINE_EXCEEDED: u8 = 4;
pub const UNIMPLEMENTED: u8 = 12;
pub const UNAVAILABLE: u8 = 14;

/// Whether a request is a gRPC call: HTTP/2 with a `application/grpc` content type (`+proto` and
/// other suffixes included).
pub fn is_grpc(parts: &hyper::http::request::Parts) -> bool {
    grpc_head(parts.version, &parts.headers)
}

/// [`is_grpc`] of a whole request.
pub fn is_grpc_request<B>(req: &Request<B>) -> bool {
    grpc_head(req.version(), req.headers())
}

/// Whether a `Content-Type` value is gRPC's (`application/grpc`, `application/grpc+proto` ...).
pub fn is_grpc_content_type(value: &[u8]) -> bool {
    value.starts_with(b"application/grpc")
}

fn grpc_head(version: hyper::Version, headers: &HeaderMap) -> bool {
    version == hyper::Version::HTTP_2
        && headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| is_grpc_content_type(v.as_bytes()))
}

/// The call's deadline from its `grpc-timeout` header (an amount of at most 8 digits and a unit:
/// `H`, `M`, `S`, `m`, `u`, `n`); none when absent or malformed.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3_600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The request as the replica gets it over h2c: `:authority` is the replica's address (the URI
/// the connector dials), so the `Host` the call was routed by is dropped rather than sent twice.
pub fn for_backend(mut req: Request<Body>) -> Request<Body> {
    req.headers_mut().remove(header::HOST);
    req
}

/// A trailers-only gRPC answer with `code` and `message` (HTTP 200, as gRPC wants).
pub fn status(code: u8, message: &str) -> Response<Body> {
    let mut r = Response::new(Empty::<Bytes>::new().map_err(|e| match e {}).boxed());
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert("grpc-status", HeaderValue::from(u16::from(code)));
    // grpc-message is percent-encoded (RFC 3986 unreserved characters and space kept).
    let encoded: String = message
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b" -_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    if let Ok(v) = HeaderValue::from_str(&encoded) {
        h.insert("grpc-message", v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_are_read_as_grpc_writes_them() {
        let t = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_str(v).unwrap());
            timeout(&h)
        };
        assert_eq!(t("250m"), Some(Duration::from_millis(250)));
        assert_eq!(t("2S"), Some(Duration::from_secs(2)));
        assert_eq!(t("1H"), Some(Duration::from_secs(3_600)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(t("123456789S"), None, "at most 8 digits");
        assert_eq!(t("5"), None);
        assert_eq!(t("m"), None);
        assert_eq!(t("5x"), None);
        assert_eq!(timeout(&HeaderMap::new()), None);
    }

    #[test]
    fn a_status_is_trailers_only_and_its_message_encoded() {
        let r = status(UNAVAILABLE, "no replica: 100% busy");
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "14");
        assert_eq!(r.headers()["grpc-message"], "no replica%3A 100%25 busy");
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/grpc");
    }
}
