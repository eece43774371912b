//! The parts of a request head that ebb routes by, read the same way on both forwarding paths
//! (RFC 9112 sections 3.2 and 3.2.2):
//!
//! * exactly one `Host` line with a valid `host[:port]` value, or 400: a second line or a bad
//!   value would let the route be chosen by one name while the app reads another (an HTTP/1.0
//!   request may leave `Host` out when its target is in absolute form);
//! * a target in absolute form (`GET http://name/path HTTP/1.1`) is routed by its authority, and
//!   the backend gets the origin form (`/path`) with that authority as its `Host`, whatever `Host`
//!   line the client sent;
//! * `OPTIONS *` is forwarded as it is; `CONNECT` is refused (405): ebb is no tunnel.

use std::borrow::Cow;

/// What a request head says about where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target<'a> {
    /// The host the request is routed by and the backend's `Host`.
    pub host: &'a str,
    /// The request target the backend gets (origin form, or `*`).
    pub path: Cow<'a, str>,
    /// The target was in absolute form: the authority replaced the `Host` line.
    pub absolute: bool,
}

/// Why a request head cannot be routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadError {
    /// More than one `Host` line.
    HostRepeated,
    /// An HTTP/2 request whose `Host` names another host than its `:authority`.
    HostConflict,
    /// No `Host` line in an HTTP/1.1 request.
    HostMissing,
    /// A `Host` value, or a target's authority, that is not `host[:port]`.
    HostInvalid,
    /// A request target in no form ebb forwards.
    TargetInvalid,
    /// `CONNECT`.
    Connect,
}

impl HeadError {
    /// The status of the answer.
    pub fn status(self) -> http::StatusCode {
        match self {
            HeadError::Connect => http::StatusCode::METHOD_NOT_ALLOWED,
            _ => http::StatusCode::BAD_REQUEST,
        }
    }

    /// The error code of the JSON answer.
    pub fn code(self) -> &'static str {
        match self {
            HeadError::HostRepeated
            | HeadError::HostConflict
            | HeadError::HostMissing
            | HeadError::HostInvalid => "bad_host",
            HeadError::TargetInvalid => "bad_target",
            HeadError::Connect => "method_not_allowed",
        }
    }

    /// Whether the connection is closed after the answer: what a refused `CONNECT` was to carry
    /// next is unknown.
    pub fn closes(self) -> bool {
        self == HeadError::Connect
    }

    /// The error message of the JSON answer.
    pub fn message(self) -> &'static str {
        match self {
            HeadError::HostRepeated => "the request has more than one Host header",
            HeadError::HostConflict => "the Host header contradicts the :authority",
            HeadError::HostMissing => "the request has no Host header",
            HeadError::HostInvalid => {
                "the Host header (or the target's authority) is not a host name"
            }
            HeadError::TargetInvalid => "the request target is not a path or an http URL",
            HeadError::Connect => "CONNECT is not served: ebb is not a tunnel",
        }
    }
}

/// Reads where a request goes from its method, target, `Host` lines (all of them, as sent) and
/// whether it is HTTP/1.1 or later.
pub fn target<'a>(
    method: &str,
    target: &'a str,
    hosts: &[&'a [u8]],
    http11: bool,
) -> Result<Target<'a>, HeadError> {
    if method.eq_ignore_ascii_case("CONNECT") {
        return Err(HeadError::Connect);
    }
    let host = match hosts {
        [] => None,
        [one] => {
            let h = one.trim_ascii();
            if !valid_host(h) {
                return Err(HeadError::HostInvalid);
            }
            Some(std::str::from_utf8(h).map_err(|_| HeadError::HostInvalid)?)
        }
        _ => return Err(HeadError::HostRepeated),
    };
    if host.is_none() && http11 {
        return Err(HeadError::HostMissing);
    }
    if target.starts_with('/') || (target == "*" && method.eq_ignore_ascii_case("OPTIONS")) {
        return Ok(Target {
            host: host.ok_or(HeadError::HostMissing)?,
            path: target.into(),
            absolute: false,
        });
    }
    let (authority, path) = absolute_form(target)?;
    Ok(Target {
        host: authority,
        path,
        absolute: true,
    })
}

/// Splits an absolute-form target into its authority and origin-form path: `/` when empty, and a
/// target of only a query gets `/` before it (`http://name?q` is `/?q`).
fn absolute_form(target: &str) -> Result<(&str, Cow<'_, str>), HeadError> {
    let (scheme, rest) = target.split_once("://").ok_or(HeadError::TargetInvalid)?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err(HeadError::TargetInvalid);
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.contains('@') || !valid_host(authority.as_bytes()) {
        return Err(HeadError::HostInvalid);
    }
    let path = match path.as_bytes().first() {
        None => "/".into(),
        Some(b'?') => format!("/{path}").into(),
        Some(b'#') => return Err(HeadError::TargetInvalid),
        Some(_) => path.into(),
    };
    Ok((authority, path))
}

/// A `Host` value (or a target's authority): `name[:port]` or `[ipv6][:port]`, where a name is
/// letters, digits, `-`, `.`, `_` and `~`, and a port is digits.
pub fn valid_host(host: &[u8]) -> bool {
    fn port(p: &[u8]) -> bool {
        p.len() <= 5 && p.iter().all(u8::is_ascii_digit)
    }
    if host.is_empty() {
        return false;
    }
    if host[0] == b'[' {
        let Some(end) = host.iter().position(|b| *b == b']') else {
            return false;
        };
        let inside = &host[1..end];
        let after = &host[end + 1..];
        return !inside.is_empty()
            && inside
                .iter()
                .all(|b| b.is_ascii_hexdigit() || *b == b':' || *b == b'.')
            && (after.is_empty() || (after[0] == b':' && port(&after[1..])));
    }
    // One pass over the name by table (this runs for every request), then the port if any.
    let name = host
        .iter()
        .take_while(|b| NAME_BYTE[usize::from(**b)])
        .count();
    name > 0
        && match &host[name..] {
            [] => true,
            [b':', p @ ..] => port(p),
            _ => false,
        }
}

/// The bytes a host name may have: letters, digits, `-`, `.`, `_` and `~`.
const NAME_BYTE: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 256 {
        let b = i as u8;
        t[i] = b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~');
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_names_with_an_optional_port() {
        for ok in [
            &b"demo.localhost"[..],
            b"demo.localhost:8080",
            b"Demo.Localhost:",
            b"[::1]",
            b"[::1]:80",
            b"127.0.0.1:80",
            b"a_b~c",
        ] {
            assert!(valid_host(ok), "{ok:?}");
        }
        for bad in [
            &b""[..],
            b"a b",
            b"a\"b",
            b"a,b",
            b"a:b:c",
            b"a:80x",
            b"a:123456",
            b"user@a",
            b"[::1",
            b"[]",
            b"[::1]x",
            b"a/b",
            b":80",
        ] {
            assert!(!valid_host(bad), "{bad:?}");
        }
    }

    proptest::proptest! {
        /// The table scan accepts exactly the names and ports the rule spells out.
        #[test]
        fn a_name_host_is_checked_as_the_rule_says(host in "[a-zA-Z0-9._~:/@ -]{0,12}") {
            let h = host.as_bytes();
            let (name, p) = match h.iter().position(|b| *b == b':') {
                Some(i) => (&h[..i], Some(&h[i + 1..])),
                None => (h, None),
            };
            let rule = !name.is_empty()
                && name.iter().all(|b| b.is_ascii_alphanumeric() || b"-._~".contains(b))
                && p.is_none_or(|p| p.len() <= 5 && p.iter().all(u8::is_ascii_digit));
            proptest::prop_assert_eq!(valid_host(h), rule);
        }
    }

    #[test]
    fn the_target_decides_over_the_host_line() {
        let t = target("GET", "/x", &[b"a.localhost"], true).unwrap();
        assert_eq!(
            (t.host, t.path.as_ref(), t.absolute),
            ("a.localhost", "/x", false)
        );
        let t = target("GET", "http://b.localhost:81/y?z", &[b"a.localhost"], true).unwrap();
        assert_eq!(
            (t.host, t.path.as_ref(), t.absolute),
            ("b.localhost:81", "/y?z", true)
        );
        let t = target("GET", "HTTP://b.localhost", &[b"a"], true).unwrap();
        assert_eq!((t.host, t.path.as_ref()), ("b.localhost", "/"));
        let t = target("GET", "http://b.localhost?q=1", &[b"a"], true).unwrap();
        assert_eq!(t.path, "/?q=1");
        // HTTP/1.0 may leave Host out when the target names the host.
        assert_eq!(target("GET", "http://b/", &[], false).unwrap().host, "b");
        assert_eq!(target("OPTIONS", "*", &[b"a"], true).unwrap().path, "*");
        for (method, t, hosts, http11, err) in [
            ("GET", "/", &[][..], true, HeadError::HostMissing),
            ("GET", "/", &[][..], false, HeadError::HostMissing),
            (
                "GET",
                "/",
                &[&b"a"[..], b"a"][..],
                true,
                HeadError::HostRepeated,
            ),
            (
                "GET",
                "http://b/",
                &[&b"a"[..], b"b"][..],
                true,
                HeadError::HostRepeated,
            ),
            ("GET", "http://b/", &[][..], true, HeadError::HostMissing),
            ("GET", "/", &[&b"a b"[..]][..], true, HeadError::HostInvalid),
            (
                "GET",
                "/",
                &[&b"a, b"[..]][..],
                true,
                HeadError::HostInvalid,
            ),
            (
                "GET",
                "http://u@b/",
                &[&b"b"[..]][..],
                true,
                HeadError::HostInvalid,
            ),
            (
                "GET",
                "http:///x",
                &[&b"b"[..]][..],
                true,
                HeadError::HostInvalid,
            ),
            (
                "GET",
                "ftp://b/",
                &[&b"b"[..]][..],
                true,
                HeadError::TargetInvalid,
            ),
            ("GET", "*", &[&b"b"[..]][..], true, HeadError::TargetInvalid),
            (
                "GET",
                "b:80",
                &[&b"b"[..]][..],
                true,
                HeadError::TargetInvalid,
            ),
            (
                "CONNECT",
                "b:443",
                &[&b"b"[..]][..],
                true,
                HeadError::Connect,
            ),
        ] {
            assert_eq!(
                target(method, t, hosts, http11),
                Err(err),
                "{method} {t} {hosts:?}"
            );
        }
    }
}
