//! Service ids: a URI naming a service, by the seed's rules.
//!
//! * It is absolute: it has a scheme.
//! * A hierarchical URI (its scheme-specific part starts with `/`) has an authority.
//! * Its path, query and fragment are dropped: `http://example.org/some/path` is the service
//!   `http://example.org`. An opaque URI (`urn:isbn:0451450523`) keeps its whole
//!   scheme-specific part.
//!
//! The scheme says what kind of service it is and who resolves it: `http`, `https`, `ws`, `wss`
//! (DNS), `conf` (a descriptor in ebb's configuration), `k8s` (a Service's EndpointSlices),
//! `k8s-env` (a Kubernetes Service's environment variables), `ebb` (one of ebb's own workloads).
//! Schemes and hosts are compared in lower case. Parsing is the `url` crate's.

use std::fmt;

/// Why a text is not a service id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("service id {text:?}: {reason}")]
pub struct IdError {
    /// The text as given.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A service's id: its scheme and its authority (hierarchical) or scheme-specific part (opaque).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceId {
    scheme: String,
    /// `host[:port]` (hierarchical; host in lower case) or the scheme-specific part (opaque).
    rest: String,
    host: Option<String>,
    port: Option<u16>,
}

impl ServiceId {
    /// Parses a service id; the path, query and fragment of a hierarchical URI are dropped.
    pub fn parse(text: &str) -> Result<ServiceId, IdError> {
        let fail = |reason: &str| IdError {
            text: text.to_owned(),
            reason: reason.to_owned(),
        };
        if text.trim() != text || text.is_empty() {
            return Err(fail("empty, or surrounded by spaces"));
        }
        let url = url::Url::parse(text).map_err(|e| match e {
            url::ParseError::RelativeUrlWithoutBase => {
                fail("not absolute: a service id starts with a scheme (`http://`, `conf://` ...)")
            }
            e => fail(&e.to_string()),
        })?;
        let scheme = url.scheme().to_owned();
        if url.cannot_be_a_base() {
            // Opaque: `scheme:rest`, everything after the colon kept.
            let rest = &text[scheme.len() + 1..];
            return Ok(ServiceId {
                scheme,
                rest: rest.to_owned(),
                host: None,
                port: None,
            });
        }
        let after = &text[scheme.len() + 1..];
        if !after.starts_with("//") {
            return Err(fail(
                "a hierarchical service id needs an authority (`scheme://host[:port]`)",
            ));
        }
        let host = match url.host_str() {
            Some(h) if !h.is_empty() => h.to_ascii_lowercase(),
            _ => return Err(fail("the authority has no host")),
        };
        if !url.username().is_empty() || url.password().is_some() {
            return Err(fail("a service id carries no user or password"));
        }
        let port = url.port();
        let rest = match port {
            Some(p) => format!("{host}:{p}"),
            None => host.clone(),
        };
        Ok(ServiceId {
            scheme,
            rest,
            host: Some(host),
            port,
        })
    }

    /// Parses an address where ebb also takes a bare `host:port` (a template's `serviceAddress`,
    /// `--peer`): text without `://` is the service `http://host:port`.
    pub fn parse_address(text: &str) -> Result<ServiceId, IdError> {
        if text.contains("://") {
            ServiceId::parse(text)
        } else {
            ServiceId::parse(&format!("http://{text}")).map_err(|e| IdError {
                text: text.to_owned(),
                reason: e.reason,
            })
        }
    }

    /// The scheme, lower case.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The host of a hierarchical id.
    pub fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// The port of a hierarchical id, if it names one.
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// `host[:port]` of a hierarchical id, or the scheme-specific part of an opaque one.
    pub fn authority(&self) -> &str {
        &self.rest
    }

    /// Whether the id is hierarchical (`scheme://authority`).
    pub fn is_hierarchical(&self) -> bool {
        self.host.is_some()
    }
}

impl fmt::Display for ServiceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_hierarchical() {
            write!(f, "{}://{}", self.scheme, self.rest)
        } else {
            write!(f, "{}:{}", self.scheme, self.rest)
        }
    }
}

impl std::str::FromStr for ServiceId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        ServiceId::parse(s)
    }
}

/// The schemes DNS discovery resolves (the binary's resolver), with their default ports.
pub const SCHEMES: [(&str, u16); 4] = [("http", 80), ("ws", 80), ("https", 443), ("wss", 443)];

/// The one instance of an id of DNS's schemes whose host is an IP address (`http://10.0.0.7`,
/// `ws://[::1]:8080`; the scheme's port when unsaid): nothing to ask a name server.
pub fn literal(id: &ServiceId) -> Option<std::net::SocketAddr> {
    let &(_, default_port) = SCHEMES.iter().find(|(s, _)| *s == id.scheme())?;
    let host = id.host()?.trim_start_matches('[').trim_end_matches(']');
    let ip: std::net::IpAddr = host.parse().ok()?;
    Some(std::net::SocketAddr::new(
        ip,
        id.port().unwrap_or(default_port),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_query_and_fragment_are_dropped() {
        let a = ServiceId::parse("http://Example.org").unwrap();
        let b = ServiceId::parse("http://example.org/some/path?q=1#f").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.to_string(), "http://example.org");
        let k = ServiceId::parse("k8s://api.shop:8080/x").unwrap();
        assert_eq!(
            (k.scheme(), k.host(), k.port()),
            ("k8s", Some("api.shop"), Some(8080))
        );
        assert_eq!(k.to_string(), "k8s://api.shop:8080");
        assert_eq!(ServiceId::parse("conf://shop").unwrap().authority(), "shop");
        // The default port of a special scheme is dropped by the parser, as the URL standard says.
        assert_eq!(
            ServiceId::parse("http://a:80").unwrap().to_string(),
            "http://a"
        );
    }

    #[test]
    fn opaque_ids_keep_their_scheme_specific_part() {
        let u = ServiceId::parse("urn:isbn:0451450523").unwrap();
        assert!(!u.is_hierarchical());
        assert_eq!(u.authority(), "isbn:0451450523");
        assert_eq!(u.to_string(), "urn:isbn:0451450523");
    }

    #[test]
    fn bad_ids_are_refused_with_a_reason() {
        for (text, says) in [
            ("", "empty"),
            (" http://a", "spaces"),
            ("example.org", "not absolute"),
            ("/a/b", "not absolute"),
            ("conf:/shop", "needs an authority"),
            ("conf:///shop", "no host"),
            ("http://user:pw@a", "no user"),
            ("http://a:99999", "invalid port"),
            ("1http://a", "not absolute"),
        ] {
            let e = ServiceId::parse(text).unwrap_err();
            assert!(e.to_string().contains(says), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_bare_address_is_an_http_service() {
        let a = ServiceId::parse_address("fn.example:8080").unwrap();
        assert_eq!(a.to_string(), "http://fn.example:8080");
        let k = ServiceId::parse_address("k8s://fn.prod:80").unwrap();
        assert_eq!(k.scheme(), "k8s");
        let e = ServiceId::parse_address("fn.example:99999").unwrap_err();
        assert_eq!(e.text, "fn.example:99999");
        assert!(e.reason.contains("invalid port"), "{e}");
    }
}
