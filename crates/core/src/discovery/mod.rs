//! Service discovery's pure half: what names a service ([`ServiceId`]), which balancer picks and
//! how ([`Policy`], [`Picker`] over [`Instance`]s), meta services' matching ([`meta`]), what a
//! Kubernetes id names ([`k8s`]) and a request's hash key. The resolvers that watch DNS and
//! the clients that use them are ebb-proxy's (`crates/proxy/src/discovery/`), the EndpointSlice
//! watches ebb-kube's (`crates/kube/src/endpoints.rs`).

pub mod balance;
pub mod id;
pub mod k8s;
pub mod meta;
pub use crate::policy;

pub use balance::{HasInstance, Instance, Outcome, PickAt, Picker, hash_key, parse_load};
pub use id::{IdError, ServiceId};
pub use policy::{Balancer, HashOn, Policy};

use std::net::IpAddr;

/// A request's hash key for consistent hashing: the value `hash_on` names, hashed ([`hash_key`]),
/// `None` when the request has none. `header` looks a header up by its lower-case name; `target`
/// is the request target (path and query).
pub fn request_key<'a>(
    hash_on: &HashOn,
    target: &str,
    header: impl Fn(&str) -> Option<&'a [u8]>,
    client: IpAddr,
) -> Option<u64> {
    match hash_on {
        HashOn::Header(name) => header(name).map(hash_key),
        HashOn::Path => Some(hash_key(
            target.split_once('?').map_or(target, |(p, _)| p).as_bytes(),
        )),
        HashOn::Query(name) => {
            let (_, query) = target.split_once('?')?;
            query
                .split('&')
                .find_map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    (k == name).then_some(v)
                })
                .map(|v| hash_key(v.as_bytes()))
        }
        HashOn::Cookie(name) => {
            let cookies = std::str::from_utf8(header("cookie")?).ok()?;
            cookies
                .split(';')
                .find_map(|c| {
                    let (k, v) = c.trim().split_once('=')?;
                    (k == name).then_some(v)
                })
                .map(|v| hash_key(v.as_bytes()))
        }
        HashOn::ClientIp => Some(match client {
            IpAddr::V4(a) => hash_key(&a.octets()),
            IpAddr::V6(a) => hash_key(&a.octets()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_keys_come_from_what_the_policy_names() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let headers = |n: &str| match n {
            "x-user" => Some(&b"ada"[..]),
            "cookie" => Some(&b"a=1; session=s42; b=2"[..]),
            _ => None,
        };
        let key =
            |h: &str, target: &str| request_key(&HashOn::parse(h).unwrap(), target, headers, ip);
        assert_eq!(key("header:x-user", "/"), Some(hash_key(b"ada")));
        assert_eq!(key("header:x-other", "/"), None);
        assert_eq!(key("path", "/a/b?x=1"), Some(hash_key(b"/a/b")));
        assert_eq!(key("query:u", "/a?x=1&u=bob"), Some(hash_key(b"bob")));
        assert_eq!(key("query:u", "/a?x=1"), None);
        assert_eq!(key("cookie:session", "/"), Some(hash_key(b"s42")));
        assert_eq!(key("client_ip", "/"), Some(hash_key(&[10, 0, 0, 1])));
    }
}
